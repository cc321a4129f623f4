"""Decode state for K3ForCausalLM: small and explicit, one entry per layer.

- KDA layers keep constant memory per sequence whatever its length: the short-conv tails of the
  q/k/v inputs (``[B, C, kernel-1]``, fp32) and the recurrent state ``S`` (``[B, H, K, V]``, fp32).
- MLA layers keep the 512+64 latent per token (``kv``: normed latent and the shared key tail,
  ``[B, T, kv_lora_rank + qk_rope_head_dim]``) plus which cached positions are real tokens.
- AttnRes mixes across depth, per token: it needs no decode state.

Prompts that are cached must be left-padded (pads first), so that every sequence's last position is a
real token; pads are neutral: they do not change KDA state and are masked out of MLA attention.

Continuous batching (``k3core.rollout.engine``) reshapes the batch between decode steps:
``index_select`` drops finished rows, ``K3Cache.concat`` appends freshly prefilled rows (the MLA
latents of shorter rows are left-padded with invalid positions, which attention masks out; K3's MLA
has no positional encoding, so where a row's tokens sit in the cache does not matter) and ``trim``
drops leading cache positions that no remaining row uses.
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

    @staticmethod
    def concat(parts: list["KDALayerCache"]) -> "KDALayerCache":
        """Rows of ``parts`` stacked along the batch (every part already prefilled)."""
        fields = ("conv_q", "conv_k", "conv_v", "state")
        if any(getattr(c, f) is None for c in parts for f in fields):
            raise ValueError("cannot concatenate an empty KDA cache: prefill every part first")
        return KDALayerCache(*(torch.cat([getattr(c, f) for c in parts]) for f in fields))


@dataclass
class MLALayerCache:
    kv: torch.Tensor | None = None  # [B, T, kv_lora_rank + qk_rope_head_dim]
    valid: torch.Tensor | None = None  # [B, T] bool

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.valid) if t is not None)

    def index_select(self, idx: torch.Tensor) -> "MLALayerCache":
        return MLALayerCache(*(None if t is None else t.index_select(0, idx) for t in (self.kv, self.valid)))

    @staticmethod
    def concat(parts: list["MLALayerCache"]) -> "MLALayerCache":
        """Rows of ``parts`` stacked along the batch; shorter parts are left-padded to the longest
        with zero latents marked invalid (``valid`` False), so their rows attend exactly as before."""
        if any(c.kv is None for c in parts):
            raise ValueError("cannot concatenate an empty MLA cache: prefill every part first")
        S = max(c.kv.shape[1] for c in parts)
        kvs, valids = [], []
        for c in parts:
            pad = S - c.kv.shape[1]
            B, _, W = c.kv.shape
            kvs.append(torch.cat([c.kv.new_zeros(B, pad, W), c.kv], 1) if pad else c.kv)
            valids.append(torch.cat([c.valid.new_zeros(B, pad), c.valid], 1) if pad else c.valid)
        return MLALayerCache(torch.cat(kvs), torch.cat(valids))

    def trim(self) -> "MLALayerCache":
        """Drop leading positions that are invalid for every row (left after longer rows left)."""
        if self.valid is None or self.valid.shape[0] == 0:
            return self
        used = self.valid.any(0)
        first = int(used.to(torch.int8).argmax()) if bool(used.any()) else self.valid.shape[1]
        if first == 0:
            return self
        return MLALayerCache(self.kv[:, first:].contiguous(), self.valid[:, first:].contiguous())


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

    @staticmethod
    def concat(parts: list["K3Cache"]) -> "K3Cache":
        """One cache holding the rows of every part, in order (e.g. the running batch, then new
        joiners prefilled on their own). ``seen_tokens`` is the longest part's."""
        if not parts:
            raise ValueError("nothing to concatenate")
        if len({len(c.layers) for c in parts}) != 1:
            raise ValueError("caches of different models cannot be concatenated")
        layers = [type(ls[0]).concat(list(ls)) for ls in zip(*(c.layers for c in parts))]
        return K3Cache(layers, max(c.seen_tokens for c in parts))

    def trim(self) -> "K3Cache":
        """Drop MLA positions no row uses any more (KDA state has nothing to trim)."""
        return K3Cache([c.trim() if isinstance(c, MLALayerCache) else c for c in self.layers], self.seen_tokens)

    @property
    def batch_size(self) -> int:
        for c in self.layers:
            t = c.kv if isinstance(c, MLALayerCache) else c.state
            if t is not None:
                return t.shape[0]
        return 0

    def kda_nbytes(self) -> int:
        """Bytes of all KDA layer state (constant per sequence, whatever its length)."""
        return sum(c.nbytes() for c in self.layers if isinstance(c, KDALayerCache))

    def mla_nbytes(self) -> int:
        """Bytes of all MLA latent caches (grow by one latent per token and MLA layer)."""
        return sum(c.nbytes() for c in self.layers if isinstance(c, MLALayerCache))
