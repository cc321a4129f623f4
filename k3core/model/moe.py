"""LatentMoE: K3's mixture of experts, routed in a latent width.

  logits  = x W_gate^T (fp32);  scores = sigmoid(logits)                              [N, E]
  chosen  = top-k of (scores + e_score_correction_bias)   (grouped top-k, noaux_tc)   [N, k]
  weights = scores[chosen] / sum(scores[chosen]) * routed_scaling_factor              unbiased scores
  y       = routed_expert_up_proj(rmsnorm(sum_j weights_j * expert_j(routed_expert_down_proj(x))))
            + shared_experts(x)

The bias shifts *selection* only, never the weights; it is a persistent fp32 buffer the optimizer
never sees (the release sets it by Quantile Balancing, no auxiliary loss; it is frozen here).
Experts are SiTU-GLU MLPs in the latent width, stored stacked: ``experts.w13`` ``[E, 2I, Dl]`` (rows
``[w1 (gate); w3 (up)]`` of the public ``experts.E.w1``/``w3``) and ``experts.w2`` ``[E, Dl, I]``.
With ``qat`` (``K3Config.qat_routed_experts``) the forward uses their MXFP4 round trip (the release's
scale rule, blocks of 32 along each weight's input dim, exactly what an MXFP4 export stores) and the
gradient passes straight through to the bf16/fp32 master weights; names and shapes do not change.

Dispatch computes only the chosen (token, expert) pairs: sort the pairs by expert, run each active
expert on its contiguous slice (``torch._grouped_mm`` on CUDA where it applies), scatter the weighted
outputs back. Counts per expert are a device ``scatter_add`` (``bincount`` on CUDA reads the max back
to size its output: a host sync). ``sync_free`` (the static decode step, captured in CUDA graphs)
never reads a device value on the host: ``_grouped_mm`` on CUDA, else the padded batched GEMM with
the capacity every expert could need (all tokens), fixed by shapes alone. ``dense_reference_moe`` runs every expert on every token: it exists for tests only.
"""

from __future__ import annotations

import torch
from torch import nn

from k3core.model.mlp import SiTUMLP
from k3core.model.norm import RMSNorm, at_least_fp32
from k3core.ops.mxfp4 import fake_quantize
from k3core.ops.situ import situ_glu


# CPU: run experts as one padded batched GEMM when routing is balanced (fewer, larger ops). Off, the
# per-expert loop runs, which saves exactly what a grouped GEMM on GPU saves (the planner's model).
CPU_PADDED_EXPERTS = True


def select_experts(biased: torch.Tensor, k: int, num_groups: int = 1, topk_groups: int = 1) -> torch.Tensor:
    """Grouped top-k (DeepSeek-V3 ``noaux_tc``): keep the ``topk_groups`` groups whose two best
    biased scores sum highest, then the top ``k`` experts inside them. biased ``[N, E]`` -> ``[N, k]``."""
    if num_groups > 1:
        N, E = biased.shape
        grouped = biased.view(N, num_groups, E // num_groups)
        group_score = grouped.topk(min(2, E // num_groups), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
        biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, E)
    return biased.topk(k, dim=-1).indices


class Router(nn.Module):
    """Public names: ``gate.weight`` ``[E, D]``, ``gate.e_score_correction_bias`` ``[E]`` (fp32 buffer)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[N, D]`` -> sigmoid scores ``[N, E]`` in fp32."""
        xf = at_least_fp32(x)
        return torch.sigmoid(xf @ self.weight.to(xf.dtype).t())


class RoutedExperts(nn.Module):
    """E SiTU-GLU experts of width I in latent width Dl, stacked for grouped matmuls. ``qat``: forward
    through the MXFP4 round trip of the weights, straight-through gradient (see the module docstring)."""

    def __init__(self, num_experts: int, latent_size: int, intermediate_size: int, beta: float, linear_beta: float,
                 qat: bool = False):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.beta, self.linear_beta = beta, linear_beta
        self.qat = qat
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, latent_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent_size, intermediate_size))

    def effective_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as the forward uses them: the parameters, or their MXFP4 round trip under QAT
        (computed once per forward, for all experts: one quantise pass per weight per step)."""
        if self.qat:
            return fake_quantize(self.w13), fake_quantize(self.w2)
        return self.w13, self.w2

    def expert_forward(self, e: int, x: torch.Tensor, weights=None) -> torch.Tensor:
        """Expert e on rows x ``[n, Dl]`` -> ``[n, Dl]``. ``weights``: ``(w13.unbind(0), w2.unbind(0))``
        when calling for many experts: indexing ``w13[e]`` per expert would make autograd build one
        full-size zero gradient per expert (quadratic in the number of experts)."""
        if weights is not None:
            w13, w2 = weights[0][e], weights[1][e]
        elif self.qat:
            w13, w2 = fake_quantize(self.w13[e]), fake_quantize(self.w2[e])  # blocks lie within one expert
        else:
            w13, w2 = self.w13[e], self.w2[e]
        return situ_glu(x @ w13.t(), self.beta, self.linear_beta) @ w2.t()

    def grouped_forward(self, x_sorted: torch.Tensor, counts: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
        """Rows sorted by expert, ``counts[e]`` rows each -> ``[n, Dl]`` in the same order.
        ``max_rows``: a bound on any ``counts[e]`` known from shapes; given, nothing reads ``counts``
        on the host (no sync: the padded path runs at that capacity unless ``_grouped_mm`` applies)."""
        w13, w2 = self.effective_weights()
        if _grouped_mm_ok(x_sorted, w13):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(situ_glu(h, self.beta, self.linear_beta), w2.transpose(-2, -1), offs=offs)
        if max_rows is not None:
            return self._padded_forward(x_sorted, counts, max_rows, (w13, w2))
        if CPU_PADDED_EXPERTS and not x_sorted.is_cuda and x_sorted.shape[0]:
            cap = int(counts.max())
            if cap * self.num_experts <= 2 * x_sorted.shape[0]:
                return self._padded_forward(x_sorted, counts, cap, (w13, w2))
        outs, start = [], 0
        weights = (w13.unbind(0), w2.unbind(0))
        for e, n in enumerate(counts.tolist()):
            if n:
                outs.append(self.expert_forward(e, x_sorted[start:start + n], weights))
                start += n
        return torch.cat(outs, 0) if outs else x_sorted.new_zeros(0, self.w2.shape[1])


    def _padded_forward(self, x_sorted: torch.Tensor, counts: torch.Tensor, cap: int, weights) -> torch.Tensor:
        """Grouped GEMM by padding (CPU): rows scattered into ``[E, cap, Dl]``, two batched matmuls,
        rows gathered back. Three large ops instead of three per expert; used when the padding at
        most doubles the work (a balanced router)."""
        n = x_sorted.shape[0]
        starts = torch.cumsum(counts, 0) - counts
        expert = torch.repeat_interleave(torch.arange(self.num_experts, device=x_sorted.device), counts, output_size=n)
        pos = torch.arange(n, device=x_sorted.device) - starts[expert]
        flat = expert * cap + pos
        xp = x_sorted.new_zeros(self.num_experts * cap, x_sorted.shape[1]).index_copy(0, flat, x_sorted)
        w13, w2 = weights
        h = torch.bmm(xp.view(self.num_experts, cap, -1), w13.transpose(1, 2))
        o = torch.bmm(situ_glu(h, self.beta, self.linear_beta), w2.transpose(1, 2))
        return o.reshape(self.num_experts * cap, -1).index_select(0, flat)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CUDA (sm90+) in bf16 with 16-byte-aligned inner dims."""
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0 and torch.cuda.get_device_capability(x.device)[0] >= 9)


class LatentMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, Dl = config.hidden_size, config.routed_expert_hidden_size
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_token
        self.num_groups, self.topk_groups = config.num_expert_group, config.topk_group
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.gate = Router(D, config.num_experts)
        self.routed_expert_down_proj = nn.Linear(D, Dl, bias=False)
        self.routed_expert_norm = RMSNorm(Dl, config.rms_norm_eps) if config.use_routed_expert_norm else nn.Identity()
        self.routed_expert_up_proj = nn.Linear(Dl, D, bias=False)
        self.experts = RoutedExperts(config.num_experts, Dl, config.moe_intermediate_size,
                                     config.activation_situ_beta, config.activation_situ_linear_beta,
                                     qat=getattr(config, "qat_routed_experts", False))
        self.shared_experts = (SiTUMLP(D, config.shared_expert_intermediate_size, config.activation_situ_beta,
                                       config.activation_situ_linear_beta) if config.num_shared_experts else None)

    def route(self, x: torch.Tensor, forced_ids: torch.Tensor | None = None,
              forced_checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, D]`` -> (expert ids ``[N, k]`` int64, weights ``[N, k]`` fp32, differentiable).
        ``forced_checked``: the caller checked the forced ids' range (``K3ForCausalLM.check_inputs``,
        once for every layer, on the host); otherwise it is checked here, which reads device values
        back (a host sync) when they live on a GPU."""
        scores = self.gate(x)
        if forced_ids is None:
            with torch.no_grad():
                ids = select_experts(scores + self.gate.e_score_correction_bias, self.top_k,
                                     self.num_groups, self.topk_groups)
        else:
            ids = forced_ids.to(device=x.device, dtype=torch.long)
            if ids.shape != (x.shape[0], self.top_k):
                raise ValueError(f"forced expert ids have shape {tuple(ids.shape)}, expected {(x.shape[0], self.top_k)}")
            if not forced_checked and ids.numel():
                lo, hi = torch.stack([ids.min(), ids.max()]).tolist()
                if lo < 0 or hi >= self.num_experts:
                    raise ValueError(f"forced expert ids must lie in [0, {self.num_experts})")
        w = scores.gather(1, ids)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        return ids, w * self.scaling

    def forward(self, x: torch.Tensor, forced_ids: torch.Tensor | None = None,
                sync_free: bool = False, forced_checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[..., D]`` -> (y ``[..., D]``, expert ids ``[..., k]``). ``sync_free``: no host sync
        in dispatch (see the module docstring; ``forced_ids`` are range-checked on the host).
        ``forced_checked``: see ``route``."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        ids, w = self.route(x2, None if forced_ids is None else forced_ids.reshape(-1, self.top_k), forced_checked)
        xl = self.routed_expert_down_proj(x2)
        yl = sparse_dispatch(self.experts, xl, ids, w, sync_free)
        y = self.routed_expert_up_proj(self.routed_expert_norm(yl))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.view(shape), ids.view(*shape[:-1], self.top_k)


def sparse_dispatch(experts: RoutedExperts, xl: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                    sync_free: bool = False) -> torch.Tensor:
    """Only the chosen pairs: xl ``[N, Dl]``, ids/w ``[N, k]`` -> weighted sum ``[N, Dl]``.
    ``sync_free``: a token picks an expert at most once, so no expert gets more than N rows."""
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.zeros(experts.num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    x_sorted = xl.index_select(0, token)
    if sync_free and isinstance(experts, RoutedExperts):
        out = experts.grouped_forward(x_sorted, counts, max_rows=N)
    else:  # W4A8 experts: their CUDA kernel builds its tile table on the device (sync-free); the CPU path reads counts
        out = experts.grouped_forward(x_sorted, counts)
    weighted = out * w.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(xl).index_add_(0, token, weighted.to(xl.dtype))


def dense_reference_moe(moe: LatentMoE, x: torch.Tensor, forced_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Every expert on every token, combined through a dense ``[N, E]`` weight matrix. Tests only."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    ids, w = moe.route(x2, None if forced_ids is None else forced_ids.reshape(-1, moe.top_k))
    combine = torch.zeros(x2.shape[0], moe.num_experts, dtype=w.dtype, device=x.device).scatter_add(1, ids, w)
    xl = moe.routed_expert_down_proj(x2)
    w13, w2 = moe.experts.effective_weights()
    weights = (w13.unbind(0), w2.unbind(0))
    all_out = torch.stack([moe.experts.expert_forward(e, xl, weights) for e in range(moe.num_experts)], dim=1)
    yl = (combine.unsqueeze(-1) * at_least_fp32(all_out)).sum(1).to(xl.dtype)
    y = moe.routed_expert_up_proj(moe.routed_expert_norm(yl))
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(x2)
    return y.view(shape)
