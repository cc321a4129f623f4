"""Gated Multi-head Latent Attention without rotary embedding (NoPE), as in K3.

  q            = q_b_proj(rmsnorm(q_a_proj(x)))                  per head: [nope (128) | tail (64)]
  [c, k_tail]  = kv_a_proj_with_mqa(x)                           latent (512) + key tail (64, shared)
  [k_nope, v]  = kv_b_proj(rmsnorm(c))                           per head: 128 + 128
  k            = [k_nope | k_tail]
  o            = softmax(q k^T * (nope + tail)^-0.5, causal) v   no rotary
  out          = o_proj(o * sigmoid(g_proj(x)))

Shapes: x ``[B, T, D]``, H = ``num_attention_heads``. Public names (``layers.N.self_attn.``):
q_a_proj ``[q_lora, D]``, q_a_layernorm ``[q_lora]``, q_b_proj ``[H*(nope+tail), q_lora]``,
kv_a_proj_with_mqa ``[kv_lora+tail, D]``, kv_a_layernorm ``[kv_lora]``, kv_b_proj ``[H*(nope+v), kv_lora]``,
g_proj ``[H*v, D]``, o_proj ``[D, H*v]``.

Decoding caches only the normed latent and the key tail per token (``kv_lora + tail`` numbers) and
attends in latent space (the "absorbed" form): ``q_nope W_k`` is scored against the latents and the
latent context is expanded once through ``W_v``; keys and values are never re-expanded. With a
``StaticMLACache`` (fixed-shape decode, one token) the new latent is written at each slot's
``lens`` position and attention runs over all ``max_len`` positions, masked to the first ``lens + 1``.

Packed sequences (``varlen``, ``k3core.model.varlen``): x ``[1, T, D]``; attention is block-diagonal
causal (a query sees the earlier tokens of its own sequence only). NoPE: no rotary embedding, so no
position ids enter here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3core.model.cache import MLALayerCache, StaticMLACache
from k3core.model.norm import RMSNorm, at_least_fp32
from k3core.model.varlen import VarlenLayout


def _attend_mask(q_len: int, k_valid: torch.Tensor, offset: int) -> torch.Tensor:
    """Boolean ``[B, 1, q_len, K]``: causal (query i sits at key position offset+i) and key is real.
    A query may always see itself, so a pad query never has an empty row (its output is ignored)."""
    K = k_valid.shape[1]
    qpos = torch.arange(q_len, device=k_valid.device).unsqueeze(1) + offset
    kpos = torch.arange(K, device=k_valid.device).unsqueeze(0)
    causal = kpos <= qpos
    return ((causal & k_valid[:, None, :]) | (kpos == qpos)).unsqueeze(1)


class GatedMLA(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads, self.layer_idx = H, layer_idx
        self.nope, self.tail, self.vdim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = (self.nope + self.tail) ** -0.5
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * (self.nope + self.tail), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, config.kv_lora_rank + self.tail, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.nope + self.vdim), bias=False)
        self.g_proj = nn.Linear(D, H * self.vdim, bias=False)
        self.o_proj = nn.Linear(H * self.vdim, D, bias=False)

    def _latent(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, kv_lora + tail]``: the normed latent and the shared key tail (what decode caches)."""
        c, k_tail = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.tail], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_tail], dim=-1)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: MLALayerCache | StaticMLACache | None = None, varlen: VarlenLayout | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, self.nope + self.tail)
        kv = self._latent(x)
        if varlen is not None:
            o = self._attend_packed(q, kv, varlen)
        elif isinstance(cache, StaticMLACache):
            o = self._attend_static(q, kv, cache)
        else:
            valid = (torch.ones(B, T, dtype=torch.bool, device=x.device) if attention_mask is None
                     else attention_mask.to(torch.bool))
            if cache is not None and cache.kv is not None:
                o = self._attend_absorbed(q, kv, valid, cache)
            else:
                if cache is not None:
                    cache.kv, cache.valid = kv, valid
                o = self._attend_expanded(q, kv, valid if attention_mask is not None else None)
        o = o.reshape(B, T, H * self.vdim)
        return self.o_proj(o * torch.sigmoid(self.g_proj(x)))

    def _attend_expanded(self, q, kv, valid):
        """Training / prefill: expand keys and values, causal SDPA. -> ``[B, T, H, v]``."""
        T = q.shape[1]
        qh, kh, vh = (t.transpose(1, 2) for t in self._expand(q, kv))
        if valid is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=_attend_mask(T, valid, 0), scale=self.scale)
        return o.transpose(1, 2)

    def _expand(self, q, kv):
        """q ``[B, T, H, nope+tail]``, latent ``[B, T, kv_lora+tail]`` -> (q, k, v) ``[B, T, H, *]``,
        keys and values expanded per head."""
        B, T, H, _ = q.shape
        c, k_tail = kv.split([self.kv_lora_rank, self.tail], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(B, T, H, self.nope + self.vdim).split([self.nope, self.vdim], dim=-1)
        k = torch.cat([k_nope, k_tail.unsqueeze(2).expand(B, T, H, self.tail)], dim=-1)
        return q, k, v

    def _attend_packed(self, q, kv, varlen: VarlenLayout):
        """Block-diagonal causal attention over the packed row -> ``[1, T, H, v]``. The sequences are
        scattered into a right-padded ``[N, T_max]`` batch and attended with a plain causal mask: a
        real query at position i sees keys 0..i of its own sequence, and the padding (after every real
        token) is never among them, so this is the block-diagonal causal mask exactly, at
        ``N * T_max^2`` instead of ``T^2`` score entries. On the GPU a fused varlen kernel would take
        the packed row directly, with no padding: flash-attention's ``flash_attn_varlen_func`` (or
        ``torch.nn.attention.varlen.varlen_attn``) with ``cu_seqlens`` and causal masking, here. Its
        flash-attention-2 kernels take one head width for q, k and v, and MLA's values (128) are
        narrower than its queries and keys (192), so v would be zero-padded to 192 and the output
        sliced back; until then SDPA (its memory-efficient kernel on CUDA) runs on the padded batch."""
        q, k, v = self._expand(q, kv)
        qh, kh, vh = (varlen.to_padded(t).transpose(1, 2) for t in (q, k, v))  # [N, H, T_max, *]
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        return varlen.from_padded(o.transpose(1, 2))

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_k ``[H, nope, kv_lora]``, W_v ``[H, v, kv_lora]``): views of kv_b_proj (never stale)."""
        W = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.vdim, self.kv_lora_rank)
        return W[:, : self.nope], W[:, self.nope:]

    def _attend_absorbed(self, q, kv_new, valid_new, cache: MLALayerCache):
        """Decode against the latent cache (appends the new tokens to it). -> ``[B, T, H, v]``."""
        B, T, H, _ = q.shape
        offset = cache.kv.shape[1]
        cache.kv = torch.cat([cache.kv, kv_new], dim=1)
        cache.valid = torch.cat([cache.valid, valid_new], dim=1)
        c, k_tail = cache.kv.split([self.kv_lora_rank, self.tail], dim=-1)  # [B, S, r], [B, S, e]
        return self._latent_attention(q, c, k_tail, _attend_mask(T, cache.valid, offset))

    def _latent_attention(self, q, c, k_tail, mask):
        """q ``[B, T, H, nope+tail]`` against latents c ``[B, S, r]`` and tails ``[B, S, e]``, mask
        ``[B, 1, T, S]`` (True = attend) -> ``[B, T, H, v]``."""
        W_k, W_v = self.absorbed_weights()
        q_nope, q_tail = q.split([self.nope, self.tail], dim=-1)
        q_lat = torch.einsum("bthn,hnr->bhtr", q_nope, W_k)
        scores = torch.einsum("bhtr,bsr->bhts", q_lat, c) + torch.einsum("bthe,bse->bhts", q_tail, k_tail)
        scores = (at_least_fp32(scores) * self.scale).masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(c.dtype)
        ctx = torch.einsum("bhts,bsr->bhtr", p, c)
        return torch.einsum("bhtr,hvr->bthv", ctx, W_v)

    def _attend_static(self, q, kv_new, cache: StaticMLACache):
        """One token per slot against the fixed-shape latent buffer, no host sync: write the new
        latent at position ``lens`` (clamped, so padding slots never write out of bounds), attend to
        positions ``<= lens``. The caller advances ``lens`` once per step. -> ``[b, 1, H, v]``."""
        b, T, H, _ = q.shape
        if T != 1:
            raise ValueError(f"static decode takes one token per slot, got {T}")
        L, W = cache.kv.shape[1], cache.kv.shape[2]
        pos = cache.lens.clamp(max=L - 1)
        cache.kv.scatter_(1, pos.view(b, 1, 1).expand(b, 1, W), kv_new)
        mask = torch.arange(L, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)  # [b, L]
        c, k_tail = cache.kv.split([self.kv_lora_rank, self.tail], dim=-1)
        return self._latent_attention(q, c, k_tail, mask[:, None, None, :])
