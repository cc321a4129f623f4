"""K3ForCausalLM: the Kimi K3 text backbone (hybrid KDA + gated MLA, Block Attention Residuals,
latent MoE, SiTU-GLU), with what RL needs on top of logits.

One forward (``K3ForCausalLM.forward``) serves training, scoring and decoding:
- ``targets`` + ``loss_mask`` -> masked mean token loss; ``return_logprobs`` -> per-token
  log-probabilities of ``targets`` (``targets[b, t]`` is the token that ``logits[b, t]`` predicts);
- ``return_routing`` -> routed expert ids per token and MoE layer ``[B, T, n_moe_layers, k]``;
  ``forced_routing`` (same shape) replays them (routing replay, "R3");
- ``cache`` (``K3Cache``) -> prefill then decode with constant KDA state and the MLA latent cache;
- ``cu_seqlens`` -> packed sequences: ``input_ids`` ``[1, T]`` holds N sequences back to back
  (offsets ``[N + 1]``, ``k3core.model.varlen``) and each is computed as if it ran alone, with no
  padding (training and scoring; ``forced_routing`` and the outputs follow the same ``[1, T]`` row).
``decode_step`` (``StaticDecodeState``) is the fixed-shape one-token decode that a CUDA graph captures.

The residual stream follows Block Attention Residuals (see ``attnres.py``): ``p`` is the current
block's partial sum and ``blocks`` the completed snapshots, the embedding output first.

Native parameter names are the public ones without the ``language_model.`` prefix, except that the
dense/shared MLPs fuse ``gate_proj``/``up_proj`` into ``gate_up_proj`` and routed experts are stacked
(``experts.w13``/``experts.w2``); ``k3core.checkpoint`` owns the one-to-one mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3core.config import K3Config
from k3core.model.attnres import ResNorm, ResProj, attn_res_mix, w_gamma
from k3core.model.cache import K3Cache, StaticDecodeState, StaticLayerCache
from k3core.model.kda import KimiDeltaAttention
from k3core.model.mla import GatedMLA
from k3core.model.mlp import SiTUMLP
from k3core.model.moe import LatentMoE
from k3core.model.norm import RMSNorm, at_least_fp32
from k3core.model.varlen import VarlenLayout
from k3core.ops.norms import fused_inference

# Parameters (and buffers) that stay fp32 whatever the model dtype, as in the release.
FP32_NAME_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


class _MixSite(nn.Module):
    """One AttnRes mixing site: w (``*_res_proj``) and gamma (``*_res_norm``) live on the layer under
    their public names; this holds only the inference cache of ``w * gamma``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", None, persistent=False)


class K3DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx, self.eps = layer_idx, eps
        self.starts_block = layer_idx % config.attn_res_block_size == 0
        self.is_mla = config.layer_type(layer_idx) == "mla"
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attention_res_proj, self.self_attention_res_norm = ResProj(D), ResNorm(D)
        self.mlp_res_proj, self.mlp_res_norm = ResProj(D), ResNorm(D)
        if layer_idx == 0:
            # the block list is still empty before layer 0's attention, so its mix never runs: the
            # public checkpoint carries these weights, but no gradient can reach them (frozen, so
            # optimizers hold no state for dead weights and every trainable parameter has one)
            self.self_attention_res_proj.weight.requires_grad_(False)
            self.self_attention_res_norm.weight.requires_grad_(False)
        self._attn_site, self._mlp_site = _MixSite(), _MixSite()
        self.self_attn = GatedMLA(config, layer_idx) if self.is_mla else KimiDeltaAttention(config, layer_idx)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(config)
        else:
            self.mlp = SiTUMLP(D, config.intermediate_size, config.activation_situ_beta, config.activation_situ_linear_beta)

    def _mix(self, p, blocks, proj, norm, site, use_cache):
        if use_cache:
            if site.cache is None:
                raise RuntimeError("AttnRes w*gamma cache is empty: call model.refresh_inference_caches() "
                                   "after loading or changing weights")
            wg = site.cache
        else:
            wg = w_gamma(proj, norm)
        return attn_res_mix(p, blocks, wg, self.eps)

    def forward(self, p, blocks, attention_mask=None, cache=None, forced_ids=None, use_cache=False, varlen=None,
                forced_checked=False):
        """p ``[B, T, D]`` partial sum, blocks list of ``[B, T, D]`` -> (p, blocks, expert ids or None).
        ``varlen`` (packed sequences) reaches the attention only: the mixes, norms and MoE act per token.
        ``forced_checked``: the forced ids' range was checked once for every layer (``check_inputs``)."""
        h = self._mix(p, blocks, self.self_attention_res_proj, self.self_attention_res_norm,
                      self._attn_site, use_cache) if blocks else p
        if self.starts_block:
            blocks = blocks + [p]
            p = self.self_attn(self.input_layernorm(h), attention_mask, cache, varlen=varlen)
        else:
            p = p + self.self_attn(self.input_layernorm(h), attention_mask, cache, varlen=varlen)
        m = self._mix(p, blocks, self.mlp_res_proj, self.mlp_res_norm, self._mlp_site, use_cache)
        if self.is_moe:
            out, ids = self.block_sparse_moe(self.post_attention_layernorm(m), forced_ids,
                                             sync_free=isinstance(cache, StaticLayerCache), forced_checked=forced_checked)
        else:
            out, ids = self.mlp(self.post_attention_layernorm(m)), None
        return p + out, blocks, ids


@dataclass
class K3Output:
    logits: torch.Tensor | None = None  # [B, T, V]
    loss: torch.Tensor | None = None  # scalar: masked mean token NLL
    logprobs: torch.Tensor | None = None  # [B, T] fp32: log p(targets)
    routing: torch.Tensor | None = None  # [B, T, n_moe_layers, k] int64
    cache: K3Cache | None = None


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.output_attn_res_proj, self.output_attn_res_norm = ResProj(D), ResNorm(D)
        self._out_site = _MixSite()


class K3ForCausalLM(nn.Module):
    """Shapes: input_ids ``[B, T]`` int64 -> logits ``[B, T, vocab]``."""

    def __init__(self, config: K3Config, init_weights: bool = True):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layer_ids = [i for i, l in enumerate(self.model.layers) if l.is_moe]
        self.use_inference_caches = False
        if init_weights:
            self.reset_parameters()

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Seeded init: N(0, initializer_range) for projections, embeddings and experts; norms 1;
        AttnRes w 0 (uniform mix at start); KDA gate, conv and router bias as their modules set them."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if name.endswith("_res_proj.weight"):
                p.zero_()
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.zero_()
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-6.0, -1.0, generator=gen))
            elif name.endswith("conv1d.weight"):
                b = p.shape[-1] ** -0.5
                p.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-b, b, generator=gen))
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen).to(p.dtype))
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias") and b.device.type != "meta":
                b.zero_()

    def cast(self, dtype: torch.dtype) -> K3ForCausalLM:
        """Cast floating parameters to ``dtype`` except the ones the release keeps in fp32."""
        for name, p in list(self.named_parameters()) + list(self.named_buffers()):
            if p is None or not p.is_floating_point() or name.endswith(FP32_NAME_SUFFIXES):
                continue
            p.data = p.data.to(dtype)
        if self.use_inference_caches:
            self.refresh_inference_caches()
        return self

    @torch.no_grad()
    def refresh_inference_caches(self) -> None:
        """Recompute every weight-derived inference cache (AttnRes ``w * gamma``). Must run after
        every weight change while ``use_inference_caches`` is on, or decoding uses stale scores.
        An existing cache is overwritten in place (same storage), so a captured CUDA graph that
        reads it sees the new values."""
        m = self.model
        sites = [(l._attn_site, l.self_attention_res_proj, l.self_attention_res_norm) for l in m.layers]
        sites += [(l._mlp_site, l.mlp_res_proj, l.mlp_res_norm) for l in m.layers]
        sites.append((m._out_site, m.output_attn_res_proj, m.output_attn_res_norm))
        for site, proj, norm in sites:
            wg = w_gamma(proj, norm).detach()
            c = site.cache
            if c is not None and c.shape == wg.shape and c.dtype == wg.dtype and c.device == wg.device:
                c.copy_(wg)
            else:
                site.cache = wg.clone()

    # ------------------------------------------------------------------ forward
    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} {tuple(input_ids.shape)}")

    def check_inputs(self, input_ids: torch.Tensor, forced_routing: torch.Tensor | None = None) -> None:
        """The value checks of ``forward``'s inputs: token ids in the vocabulary, forced expert ids in
        ``[0, num_experts)``. Each reads the tensor's range: free on the host, one device -> host read
        (a wait for the GPU queue) per tensor on a GPU. ``forward`` runs them unless told
        (``inputs_checked``) that its caller ran them on the host tensors it built the batch from."""
        self._check_ids(input_ids)
        V = self.config.vocab_size
        if input_ids.numel():
            lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()
            if lo < 0 or hi >= V:
                bad = ((input_ids < 0) | (input_ids >= V)).nonzero()[0].tolist()
                raise ValueError(f"token id {int(input_ids[bad[0], bad[1]])} at position {tuple(bad)} is outside the "
                                 f"vocabulary [0, {V}): tokenize with this model's tokenizer (vocab_size={V})")
        if forced_routing is not None and forced_routing.numel():
            E = self.config.num_experts
            lo, hi = torch.stack([forced_routing.min(), forced_routing.max()]).tolist()
            if lo < 0 or hi >= E:
                raise ValueError(f"forced expert ids must lie in [0, {E})")

    def _trunk(self, input_ids, attention_mask, layer_caches, forced_routing, varlen=None,
               forced_checked=False) -> tuple[torch.Tensor, list]:
        """Embedding, layers, output mix and head -> (logits ``[B, T, V]``, routed ids per MoE layer).
        An engine model (inference caches on) runs its norms as fused kernels on CUDA (``k3core.ops.norms``)."""
        with fused_inference(self.use_inference_caches):
            return self._layers_and_head(input_ids, attention_mask, layer_caches, forced_routing, varlen, forced_checked)

    def _layers_and_head(self, input_ids, attention_mask, layer_caches, forced_routing, varlen, forced_checked):
        use_cache = self.use_inference_caches
        p = self.model.embed_tokens(input_ids)
        blocks: list[torch.Tensor] = []
        routing = []
        for i, layer in enumerate(self.model.layers):
            forced = None
            if forced_routing is not None and layer.is_moe:
                forced = forced_routing[:, :, len(routing)]
            cache = layer_caches[i] if layer_caches is not None else None
            p, blocks, ids = layer(p, blocks, attention_mask, cache, forced, use_cache, varlen, forced_checked)
            if ids is not None:
                routing.append(ids)
        m = self.model
        if use_cache:
            wg = m._out_site.cache
            if wg is None:
                raise RuntimeError("AttnRes w*gamma cache is empty: call refresh_inference_caches()")
        else:
            wg = w_gamma(m.output_attn_res_proj, m.output_attn_res_norm)
        h = m.norm(attn_res_mix(p, blocks, wg, self.config.rms_norm_eps))
        return self.lm_head(h), routing

    @torch.no_grad()
    def decode_step(self, state: StaticDecodeState, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token for each of the first ``b`` slots of ``state``: reads ``state.tokens[:b]``,
        updates the slots' KDA state, conv tails and MLA latents in place and advances ``state.lens``.
        -> (logits ``[b, V]``, routed expert ids ``[b, n_moe_layers, k]``). Fixed shapes, fixed
        storage and no host sync (no id check either: the ids were sampled from this model), so a
        CUDA graph can capture it; slots beyond the caller's sequences decode as harmless padding."""
        logits, routing = self._trunk(state.tokens[:b].view(b, 1), None, state.views(b), None)
        state.lens[:b].add_(1)
        k = self.config.num_experts_per_token
        ids = torch.stack(routing, dim=1)[:, :, 0] if routing else state.tokens.new_zeros(b, 0, k)
        return logits[:, 0], ids

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                targets: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                return_logits: bool = True, return_logprobs: bool = False, return_routing: bool = False,
                forced_routing: torch.Tensor | None = None, cache: K3Cache | None = None,
                cu_seqlens: torch.Tensor | None = None, inputs_checked: bool = False, pixel_values=None,
                **kwargs) -> K3Output:
        """``inputs_checked``: the caller ran ``check_inputs`` on the host tensors it built
        ``input_ids`` and ``forced_routing`` from, so the range checks, which read device values
        back, are skipped (shapes and dtypes are checked always)."""
        if pixel_values is not None or any(k in kwargs for k in ("image_grid_thw", "pixel_values_videos", "images")):
            raise NotImplementedError("multimodal (MoonViT) inputs are not supported: k3rl trains the K3 text "
                                      "backbone only; pass token ids without images")
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        self._check_ids(input_ids)
        B, T = input_ids.shape
        if attention_mask is not None and attention_mask.shape != (B, T):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, T)}")
        n_moe, k = len(self.moe_layer_ids), self.config.num_experts_per_token
        if forced_routing is not None and tuple(forced_routing.shape) != (B, T, n_moe, k):
            raise ValueError(f"forced_routing has shape {tuple(forced_routing.shape)}, expected {(B, T, n_moe, k)}")
        if not inputs_checked:
            self.check_inputs(input_ids, forced_routing)
        varlen = None
        if cu_seqlens is not None:
            if B != 1 or attention_mask is not None or cache is not None:
                raise ValueError(f"packed sequences (cu_seqlens) take input_ids [1, T] with no attention_mask and no "
                                 f"cache (there is no padding to mask, and decoding is not packed); got input_ids "
                                 f"{tuple(input_ids.shape)}, attention_mask "
                                 f"{'given' if attention_mask is not None else 'None'}, cache "
                                 f"{'given' if cache is not None else 'None'}")
            varlen = VarlenLayout.from_cu_seqlens(cu_seqlens, T, input_ids.device)
        logits, routing = self._trunk(input_ids, attention_mask, cache.layers if cache is not None else None,
                                      forced_routing, varlen, forced_checked=True)
        out = K3Output(cache=cache)
        if cache is not None:
            cache.seen_tokens += T
        if return_routing:
            out.routing = torch.stack(routing, dim=2) if routing else input_ids.new_zeros(B, T, 0, k)
        if targets is not None:
            if targets.shape != (B, T):
                raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {(B, T)}")
            logp = token_logprobs(logits, targets)
            if return_logprobs:
                out.logprobs = logp
            mask = torch.ones_like(logp) if loss_mask is None else loss_mask.to(logp.dtype)
            out.loss = -(logp * mask).sum() / mask.sum().clamp_min(1.0)
        elif return_logprobs:
            raise ValueError("return_logprobs needs targets (the token each position predicts)")
        if return_logits:
            out.logits = logits
        return out


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets] in fp32; logits ``[B, T, V]``, targets ``[B, T]`` -> ``[B, T]``.
    Out-of-range targets (e.g. a pad id beyond the vocabulary) are refused."""
    V = logits.shape[-1]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise ValueError(f"targets must lie in [0, {V}); mask padded positions with loss_mask instead of ids outside the vocabulary")
    lf = at_least_fp32(logits)
    return lf.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lf, dim=-1)
