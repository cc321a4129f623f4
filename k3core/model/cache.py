"""Decode state for K3ForCausalLM: small and explicit, one entry per layer.

- KDA layers keep constant memory per sequence whatever its length: the short-conv tails of the
  q/k/v inputs (``[B, C, kernel-1]``, fp32) and the recurrent state ``S`` (``[B, H, K, V]``, fp32).
- MLA layers keep the 512+64 latent per token (``kv``: normed latent and the shared key tail,
  ``[B, T, kv_lora_rank + qk_rope_head_dim]``) plus which cached positions are real tokens.
- AttnRes mixes across depth, per token: it needs no decode state.

Prompts that are cached must be left-padded (pads first), so that every sequence's last position is a
real token; pads are neutral: they do not change KDA state and are masked out of MLA attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDALayerCache:
    conv_q: torch.Tensor | None = None  # [B, C, kernel-1] fp32
    conv_k: torch.Tensor | None = None
    conv_v: torch.Tensor | None = None
    state: torch.Tensor | None = None  # [B, H, K, V] fp32

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_q, self.conv_k, self.conv_v, self.state) if t is not None)

    def index_select(self, idx: torch.Tensor) -> "KDALayerCache":
        return KDALayerCache(*(None if t is None else t.index_select(0, idx) for t in (self.conv_q, self.conv_k, self.conv_v, self.state)))


@dataclass
class MLALayerCache:
    kv: torch.Tensor | None = None  # [B, T, kv_lora_rank + qk_rope_head_dim]
    valid: torch.Tensor | None = None  # [B, T] bool

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.valid) if t is not None)

    def index_select(self, idx: torch.Tensor) -> "MLALayerCache":
        return MLALayerCache(*(None if t is None else t.index_select(0, idx) for t in (self.kv, self.valid)))


@dataclass
class K3Cache:
    layers: list = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def empty(cls, config) -> "K3Cache":
        return cls([MLALayerCache() if config.layer_type(i) == "mla" else KDALayerCache()
                    for i in range(config.num_hidden_layers)])

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)

    def index_select(self, idx: torch.Tensor) -> "K3Cache":
        """Keep only the sequences ``idx`` (e.g. drop finished ones from a batch)."""
        return K3Cache([c.index_select(idx) for c in self.layers], self.seen_tokens)
