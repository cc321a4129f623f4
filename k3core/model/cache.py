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

``StaticDecodeState`` is the same decode state with fixed shapes and fixed storage, for one-token
decode steps that a CUDA graph can capture (``K3ForCausalLM.decode_step``): ``slots`` rows, each
holding one sequence; KDA state and conv tails ``[slots, ...]`` overwritten in place; MLA latents
``[slots, max_len, kv_lora_rank + qk_rope_head_dim]`` with ``lens[slot]`` latents held per slot (the
next write position), attention over ``max_len`` masked to the first ``lens + 1``. A decode step on
the first ``b`` slots reads and writes views of these buffers only. Prefill stays dynamic: its
``K3Cache`` rows are copied into slots (``load``; an MLA row's real latents packed to the front).
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

    def index_select(self, idx: torch.Tensor) -> KDALayerCache:
        return KDALayerCache(*(None if t is None else t.index_select(0, idx) for t in (self.conv_q, self.conv_k, self.conv_v, self.state)))

    @staticmethod
    def concat(parts: list[KDALayerCache]) -> KDALayerCache:
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

    def index_select(self, idx: torch.Tensor) -> MLALayerCache:
        return MLALayerCache(*(None if t is None else t.index_select(0, idx) for t in (self.kv, self.valid)))

    @staticmethod
    def concat(parts: list[MLALayerCache]) -> MLALayerCache:
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

    def trim(self) -> MLALayerCache:
        """Drop leading positions that are invalid for every row (left after longer rows left)."""
        if self.valid is None or self.valid.shape[0] == 0:
            return self
        used = self.valid.any(0)
        first = int(used.to(torch.int8).argmax()) if bool(used.any()) else self.valid.shape[1]
        if first == 0:
            return self
        return MLALayerCache(self.kv[:, first:].contiguous(), self.valid[:, first:].contiguous())


class StaticLayerCache:
    """Marks the per-layer views of a ``StaticDecodeState`` (layers update them in place)."""


@dataclass
class StaticKDACache(StaticLayerCache):
    conv_q: torch.Tensor  # [b, C, kernel-1] fp32 (fp64 for fp64 models)
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    state: torch.Tensor  # [b, H, K, V] fp32 (fp64 for fp64 models)


@dataclass
class StaticMLACache(StaticLayerCache):
    kv: torch.Tensor  # [b, max_len, kv_lora_rank + qk_rope_head_dim]
    lens: torch.Tensor  # [b] int64: latents held per slot (shared by every MLA layer)


class StaticDecodeState:
    """Fixed-shape decode state for ``slots`` sequences of up to ``max_len`` tokens (see the module
    docstring). Rows are slots; which sequence sits in which slot is the caller's business."""

    def __init__(self, config, slots: int, max_len: int, dtype: torch.dtype, device):
        if slots < 1 or max_len < 1:
            raise ValueError(f"a static decode state needs slots >= 1 and max_len >= 1, got {slots}, {max_len}")
        self.config, self.slots, self.max_len, self.dtype = config, slots, max_len, dtype
        self.device = torch.device(device)
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        H, K = config.kda_num_heads, config.kda_head_dim
        tail = config.kda_short_conv_kernel_size - 1
        W = config.kv_lora_rank + config.qk_rope_head_dim
        zeros = lambda *shape, dt=state_dtype: torch.zeros(*shape, dtype=dt, device=self.device)  # noqa: E731
        self.tokens = torch.zeros(slots, dtype=torch.long, device=self.device)  # decode-step input ids
        self.lens = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(config.num_hidden_layers):
            if config.layer_type(i) == "mla":
                self.layers.append({"kv": zeros(slots, max_len, W, dt=dtype)})
            else:
                self.layers.append({"conv_q": zeros(slots, H * K, tail), "conv_k": zeros(slots, H * K, tail),
                                    "conv_v": zeros(slots, H * K, tail), "state": zeros(slots, H, K, K)})

    def views(self, b: int) -> list[StaticLayerCache]:
        """Per-layer caches over the first ``b`` slots (views: writes land in the buffers)."""
        if not 1 <= b <= self.slots:
            raise ValueError(f"decode batch {b} does not fit the {self.slots} slots of the static decode state")
        return [StaticMLACache(bufs["kv"][:b], self.lens[:b]) if "kv" in bufs
                else StaticKDACache(**{k: t[:b] for k, t in bufs.items()}) for bufs in self.layers]

    def buffers(self) -> list[torch.Tensor]:
        """Every per-slot buffer (dim 0 is the slot)."""
        return [self.tokens, self.lens] + [t for bufs in self.layers for t in bufs.values()]

    @torch.no_grad()
    def load(self, cache: K3Cache, slots: list[int]) -> None:
        """Copy the rows of a prefilled dynamic ``cache`` into ``slots`` (row i -> slots[i])."""
        if len(slots) != cache.batch_size:
            raise ValueError(f"{cache.batch_size} cache rows for {len(slots)} slots")
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        lens = None
        for bufs, c in zip(self.layers, cache.layers):
            if isinstance(c, KDALayerCache):
                for name, t in bufs.items():
                    t.index_copy_(0, idx, getattr(c, name).to(t.dtype))
                continue
            n = c.valid.sum(1)
            if lens is None:
                lens = n
                if int(n.max()) > self.max_len:
                    raise ValueError(f"a prefilled row holds {int(n.max())} tokens, more than max_len={self.max_len}")
            for i, s in enumerate(slots):  # the real latents, packed to the front (NoPE: order is free)
                bufs["kv"][s, : int(n[i])] = c.kv[i][c.valid[i]]
        if lens is not None:
            self.lens.index_copy_(0, idx, lens.to(self.device))

    @torch.no_grad()
    def row(self, slot: int) -> K3Cache:
        """A copy of ``slot``'s state as a one-row dynamic ``K3Cache`` (its latents all valid)."""
        n = int(self.lens[slot])
        layers = []
        for bufs in self.layers:
            if "kv" in bufs:
                layers.append(MLALayerCache(bufs["kv"][slot:slot + 1, :n].clone(),
                                            torch.ones(1, n, dtype=torch.bool, device=self.device)))
            else:
                layers.append(KDALayerCache(*(bufs[k][slot:slot + 1].clone()
                                              for k in ("conv_q", "conv_k", "conv_v", "state"))))
        return K3Cache(layers, n)

    @torch.no_grad()
    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy slots ``src[i]`` -> ``dst[i]`` (the two lists disjoint), e.g. to close holes."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for t in self.buffers():
            t.index_copy_(0, d, t.index_select(0, s))

    def release(self, start: int) -> None:
        """Slots ``start..`` hold no sequence: zero their lengths (they decode as padding)."""
        self.lens[start:].zero_()

    @torch.no_grad()
    def resized(self, slots: int, max_len: int, keep: int) -> StaticDecodeState:
        """A new state of ``slots`` x ``max_len`` holding this one's first ``keep`` slots."""
        if max_len < self.max_len and keep and int(self.lens[:keep].max()) > max_len:
            raise ValueError("cannot shrink max_len below a held sequence")
        out = StaticDecodeState(self.config, slots, max_len, self.dtype, self.device)
        L = min(max_len, self.max_len)
        out.tokens[:keep].copy_(self.tokens[:keep])
        out.lens[:keep].copy_(self.lens[:keep])
        for new, old in zip(out.layers, self.layers):
            for name, t in new.items():
                (t[:keep, :L] if name == "kv" else t[:keep]).copy_(old[name][:keep, :L] if name == "kv" else old[name][:keep])
        return out

    def stats(self, n: int) -> dict:
        """Bytes of the first ``n`` slots: KDA state (constant) and the MLA latents they hold."""
        kda = sum(t[:n].numel() * t.element_size() for bufs in self.layers if "kv" not in bufs for t in bufs.values())
        held = int(self.lens[:n].sum()) if n else 0
        mla = sum(held * bufs["kv"].shape[2] * bufs["kv"].element_size() for bufs in self.layers if "kv" in bufs)
        return {"kda_bytes": kda, "mla_bytes": mla}


@dataclass
class K3Cache:
    layers: list = field(default_factory=list)
    seen_tokens: int = 0

    @classmethod
    def empty(cls, config) -> K3Cache:
        return cls([MLALayerCache() if config.layer_type(i) == "mla" else KDALayerCache()
                    for i in range(config.num_hidden_layers)])

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)

    def index_select(self, idx: torch.Tensor) -> K3Cache:
        """Keep only the sequences ``idx`` (e.g. drop finished ones from a batch)."""
        return K3Cache([c.index_select(idx) for c in self.layers], self.seen_tokens)

    @staticmethod
    def concat(parts: list[K3Cache]) -> K3Cache:
        """One cache holding the rows of every part, in order (e.g. the running batch, then new
        joiners prefilled on their own). ``seen_tokens`` is the longest part's."""
        if not parts:
            raise ValueError("nothing to concatenate")
        if len({len(c.layers) for c in parts}) != 1:
            raise ValueError("caches of different models cannot be concatenated")
        layers = [type(ls[0]).concat(list(ls)) for ls in zip(*(c.layers for c in parts))]
        return K3Cache(layers, max(c.seen_tokens for c in parts))

    def trim(self) -> K3Cache:
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
