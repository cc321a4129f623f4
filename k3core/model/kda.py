"""Kimi Delta Attention layer (the linear-attention layer of K3).

Per token t and head h (Kimi Linear / K3; the recurrence is computed by ``k3core.ops.kda``):
  q, k, v = SiLU(causal depthwise conv1d(q_proj(x), k_proj(x), v_proj(x)))   kernel 4, no bias
  f       = f_b_proj(f_a_proj(x))                                            low rank (rank = head_dim)
  g       = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))             log-space decay in [lb, 0)
  beta    = sigmoid(b_proj(x))
  S_t     = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T  (q, k L2-normalised)
  o_t     = head_dim^-0.5 * q_t^T S_t
  out     = o_proj(rmsnorm_per_head(o) * sigmoid(g_proj(x)))                  full-rank output gate

Shapes: x ``[B, T, D]``; heads H = ``kda_num_heads``, K = V = ``kda_head_dim``. Packed (``varlen``,
``k3core.model.varlen``): x ``[1, T, D]`` holds several sequences; the convolution sees zeros before
each sequence's first token and the recurrence starts each sequence from a zero state
(``cu_seqlens``: fla's varlen ``chunk_kda`` on CUDA, the torch chunked path elsewhere).
Public names (``layers.N.self_attn.``): q_proj/k_proj/v_proj/g_proj ``[H*K, D]``, o_proj ``[D, H*K]``,
f_a_proj ``[K, D]``, f_b_proj ``[H*K, K]``, b_proj ``[H, D]``, {q,k,v}_conv1d ``[H*K, 1, kernel]``
(fp32), A_log ``[H]`` (fp32; padded in public files), dt_bias ``[H*K]`` (fp32), o_norm ``[K]`` (fp32).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3core.model.cache import KDALayerCache, StaticKDACache
from k3core.model.norm import at_least_fp32, rms_norm
from k3core.model.varlen import VarlenLayout
from k3core.ops.kda import _fla, kda, kda_gate, kda_step

# CUDA training and scoring run the packed short convolutions through fla's varlen kernel
# (``_fla.short_conv_packed``); off, or without fla, the torch path below runs everywhere.
FLA_SHORT_CONV = True


class ShortConv(nn.Module):
    """Causal depthwise conv1d + SiLU, fp32 weights ``[C, 1, kernel]``, with a carried tail for decode."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32))
        nn.init.uniform_(self.weight, -1 / math.sqrt(kernel), 1 / math.sqrt(kernel))

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[B, T, C]``, tail ``[B, C, kernel-1]`` or None (zeros) -> (y ``[B, T, C]``, new tail)."""
        B, T, C = x.shape
        xt = at_least_fp32(x.transpose(1, 2))
        if tail is None:
            tail = xt.new_zeros(B, C, self.kernel - 1)
        xp = torch.cat([tail, xt], dim=2)
        y = F.conv1d(xp, self.weight.to(xp.dtype), groups=C)
        return F.silu(y).transpose(1, 2).to(x.dtype), xp[..., xp.shape[-1] - (self.kernel - 1):]

    def forward_packed(self, x: torch.Tensor, varlen: VarlenLayout) -> torch.Tensor:
        """x ``[1, T, C]`` of packed sequences -> y ``[1, T, C]``, each sequence convolved as if alone.
        The row is re-laid with ``kernel - 1`` zeros in front of every sequence (what each sees alone:
        no tail), one unpadded conv1d runs over it, and the outputs at the real tokens are read back,
        so no token of one sequence reaches the next. Same conv1d as ``forward`` (same numerics),
        one copy of the input saved for backward. On CUDA with fla: fla's varlen kernel instead,
        this path being its reference."""
        if FLA_SHORT_CONV and x.is_cuda and _fla.available():
            return _fla.short_conv_packed(x, self.weight.view(self.weight.shape[0], self.kernel),
                                          varlen.cu_seqlens_device, varlen.cu_seqlens)
        T, C = x.shape[1], x.shape[2]
        gap = self.kernel - 1
        # position of every packed token in the re-laid row: shifted by the gaps up to its sequence's
        at = torch.arange(T, device=x.device) + (varlen.seq_ids + 1) * gap
        xt = at_least_fp32(x[0]).t()  # [C, T]
        xp = xt.new_zeros(C, T + varlen.num_sequences * gap).index_copy(1, at, xt)
        y = F.conv1d(xp.unsqueeze(0), self.weight.to(xp.dtype), groups=C)[0]  # [C, len - gap]
        return F.silu(y.index_select(1, at - gap)).t().unsqueeze(0).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        D, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        self.num_heads, self.head_dim, self.eps = H, K, config.rms_norm_eps
        self.lower_bound = float(config.kda_gate_lower_bound)
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        self.q_conv1d = ShortConv(H * K, config.kda_short_conv_kernel_size)
        self.k_conv1d = ShortConv(H * K, config.kda_short_conv_kernel_size)
        self.v_conv1d = ShortConv(H * K, config.kda_short_conv_kernel_size)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, H * K, bias=False)
        self.o_proj = nn.Linear(H * K, D, bias=False)
        # exp(A_log) = 1 and dt_bias in [-6, -1]: gates start in about [-1.3, -0.01] (long memory)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(H * K, dtype=torch.float32).uniform_(-6.0, -1.0))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(K, dtype=torch.float32))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KDALayerCache | StaticKDACache | None = None, varlen: VarlenLayout | None = None) -> torch.Tensor:
        """x ``[B, T, D]``; attention_mask ``[B, T]`` (True = real token) makes pads neutral;
        cache (updated in place) carries conv tails and the recurrent state across calls. A
        ``StaticKDACache`` (one token per slot) has its buffers overwritten (``copy_``), so their
        storage never moves (what a captured CUDA graph needs). ``varlen``: x ``[1, T, D]`` holds
        packed sequences (training and scoring; no mask, no cache)."""
        if varlen is not None:
            return self._forward_packed(x, varlen)
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        mask = None if attention_mask is None else attention_mask.to(torch.bool).unsqueeze(-1)
        q_in, k_in, v_in = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if mask is not None:  # a pad contributes nothing to the conv tails
            q_in, k_in, v_in = (t.masked_fill(~mask, 0) for t in (q_in, k_in, v_in))
        q, cq = self.q_conv1d(q_in, cache.conv_q if cache is not None else None)
        k, ck = self.k_conv1d(k_in, cache.conv_k if cache is not None else None)
        v, cv = self.v_conv1d(v_in, cache.conv_v if cache is not None else None)
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        g = kda_gate(f, self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(at_least_fp32(self.b_proj(x)))
        if mask is not None:  # a pad neither decays nor writes the state
            g = g.masked_fill(~mask.unsqueeze(-1), 0.0)
            beta = beta.masked_fill(~mask, 0.0)
        q, k, v = (t.view(B, T, H, K) for t in (q, k, v))
        state = cache.state if cache is not None else None
        if isinstance(cache, StaticKDACache) and T != 1:
            raise ValueError(f"static decode takes one token per slot, got {T}")
        if cache is not None and T == 1 and state is not None:
            # a static cache's state is advanced where it lies: read and written once per step
            o, new_state = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state,
                                    inplace=isinstance(cache, StaticKDACache))
            o = o.unsqueeze(1)
        else:
            o, new_state = kda(q, k, v, g, beta, initial_state=state, output_final_state=cache is not None,
                               lower_bound=self.lower_bound)  # g >= lower_bound: fla's safe-gate path
        if isinstance(cache, StaticKDACache):
            for buf, new in zip((cache.conv_q, cache.conv_k, cache.conv_v, cache.state), (cq, ck, cv, new_state)):
                if new is not buf:
                    buf.copy_(new)
        elif cache is not None:
            cache.conv_q, cache.conv_k, cache.conv_v, cache.state = cq, ck, cv, new_state
        o = rms_norm(o.to(x.dtype), self.o_norm.weight, self.eps).reshape(B, T, H * K)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))

    def _forward_packed(self, x: torch.Tensor, varlen: VarlenLayout) -> torch.Tensor:
        """The forward of ``x`` ``[1, T, D]`` whose sequences ``varlen`` delimits: every sequence as
        if run alone (conv without a tail, recurrence from a zero state)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        q, k, v = (conv.forward_packed(proj(x), varlen).view(B, T, H, K) for conv, proj in
                   ((self.q_conv1d, self.q_proj), (self.k_conv1d, self.k_proj), (self.v_conv1d, self.v_proj)))
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(at_least_fp32(self.b_proj(x)))
        # the offsets on the device, copied once per forward for every layer, and on the host
        o, _ = kda(q, k, v, g, beta, cu_seqlens=varlen.cu_seqlens_device, cu_seqlens_cpu=varlen.cu_seqlens,
                   lower_bound=self.lower_bound)
        o = rms_norm(o.to(x.dtype), self.o_norm.weight, self.eps).reshape(B, T, H * K)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))
