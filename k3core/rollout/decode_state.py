"""The running batch's decode state, in the rollout engine's two shapes: dynamic and static.

Owns: ``DecodeState`` (what the engine asks of it: rows join after prefill, rows retire, one decode
step for every row, storage dropped between batches), its two shapes ``DynamicDecode`` and
``StaticDecode``, and which decode mode a model can run (``resolve_decode``). Does not own:
the cache tensors and the decode step (``k3core.model.cache``, ``K3ForCausalLM.decode_step``),
capturing that step (``k3core.rollout.decode_graphs``), sampling or which sequence runs
(``k3core.rollout.engine``). Row ``j`` of the state is the engine's running sequence ``j``.

Modes. "dynamic": a ``K3Cache`` reshaped with the batch (joiners' rows concatenated, retired rows
dropped and leading positions no row uses trimmed); each step is an ordinary forward. "static": each
sequence's state is copied after prefill into its slot of a fixed-shape
``k3core.model.cache.StaticDecodeState`` (running sequence j in slot j; when sequences leave, the
last ones move into the holes), the batch is padded up to a bucket (1, 2, 4, ... up to
``max_batch``) and each step is ``K3ForCausalLM.decode_step``: fixed shapes, fixed storage, no host
sync. The slots grow to the next bucket, and the length to the next power of two that holds every
running sequence's prompt + ``max_new_tokens``, when admission needs it. "graph": "static" with each
bucket's step captured once as a CUDA graph and replayed; sampling stays outside the graph. A graph
reads weights by address, so the engine reports every weight load (``weights_loaded``) and graphs
whose weights moved are captured again. Prefill is the same eager forward in every mode.

What can be captured: float experts, and W4A8 experts where their Triton kernel runs (CUDA), which
builds its tile table on the device from the expert counts
(``k3core.ops.w4a8.grouped_mm_triton.device_tiles``). Weight-only MXFP4 experts (the torch path)
read the counts on the host and cannot be captured. The engine takes a resolved mode: "auto" has
one meaning, ``k3core.device.decode_mode``'s. The modes' outcomes and speeds are in
docs/results/rollout_decode.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from k3core.model import K3Cache, K3ForCausalLM
from k3core.model import cache as model_cache
from k3core.model.norm import at_least_fp32
from k3core.rollout.decode_graphs import DecodeGraphs, bucket


def resolve_decode(model: K3ForCausalLM, decode: str) -> str:
    """The mode an engine around ``model`` runs for a resolved ``decode``; a mode the
    model's device or experts cannot run is refused with a ``ValueError`` naming the way out."""
    from k3core.ops.w4a8 import triton_available
    from k3core.rollout.quantized import expert_format

    device = next(model.parameters()).device
    fmt = expert_format(model)
    # W4A8 experts: the Triton kernel's tile table is built on the device (no host read of the
    # counts); weight-only MXFP4 (w4a16) runs the torch path, which reads them
    capturable = fmt in ("bf16", "none") or (fmt == "w4a8" and device.type == "cuda" and triton_available())
    if decode == "graph" and device.type != "cuda":
        raise ValueError(f"decode='graph' needs a CUDA model (this one is on {device}); use 'static' or 'dynamic'")
    if decode == "graph" and not capturable:
        raise ValueError(f"decode='graph' cannot capture {fmt} experts here (they need the W4A8 Triton kernel on "
                         "CUDA, which tiles on the device); use 'static' or 'dynamic'")
    return decode


class DecodeState(ABC):
    """The decode state of the running batch: row ``j`` holds running sequence ``j``."""

    mode: str  # "dynamic", "static" or "graph"

    @abstractmethod
    def admit(self, prefilled: K3Cache, held: int, max_len: int) -> None:
        """Append the rows of ``prefilled`` (the joiners' prefill, one row each) after the first
        ``held`` rows. ``max_len``: the longest prompt + ``max_new_tokens`` of any running sequence."""

    @abstractmethod
    def retire(self, keep: list[int]) -> list[int]:
        """Keep only rows ``keep`` (ascending, not empty). Returns, for each row afterwards, the row
        it was before: the order the caller's per-row lists must take."""

    @abstractmethod
    def row(self, j: int) -> K3Cache:
        """A copy of row ``j``'s state as a one-row dynamic cache (kept for its session's next turn)."""

    @abstractmethod
    def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``tokens`` ``[n]`` (one per row) -> (next logits ``[n, V]`` fp32 or wider, routed expert
        ids ``[n, n_moe, k]``). The logits are the caller's to keep."""

    @abstractmethod
    def clear(self) -> None:
        """No row holds a sequence any more; storage may be kept for the next batch."""

    @abstractmethod
    def free(self) -> None:
        """Drop all storage (between batches); the next ``admit`` allocates again."""

    @abstractmethod
    def weights_loaded(self) -> None:
        """The model's weights were copied in place (``RolloutEngine.load_weights``)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of decode state held now, whether or not rows use them."""

    @abstractmethod
    def stats(self, n: int) -> dict:
        """``kda_bytes`` (constant per sequence) and ``mla_bytes`` (per token) of the ``n`` rows in use."""


class DynamicDecode(DecodeState):
    """A ``K3Cache`` that grows and shrinks with the batch; each step is an ordinary forward."""

    mode = "dynamic"

    def __init__(self, model: K3ForCausalLM):
        self.model = model
        self.cache: K3Cache | None = None

    def admit(self, prefilled: K3Cache, held: int, max_len: int) -> None:
        self.cache = prefilled if held == 0 else K3Cache.concat([self.cache, prefilled])

    def retire(self, keep: list[int]) -> list[int]:
        idx = torch.tensor(keep, device=self.model.lm_head.weight.device)
        self.cache = self.cache.index_select(idx).trim()
        return keep

    def row(self, j: int) -> K3Cache:
        return self.cache.index_select(torch.tensor([j], device=self.model.lm_head.weight.device)).trim()

    def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = tokens.shape[0]
        out = self.model(tokens.view(B, 1), torch.ones(B, 1, dtype=torch.bool, device=tokens.device),
                         cache=self.cache, return_routing=True)
        return at_least_fp32(out.logits[:, -1]), out.routing[:, 0]

    def clear(self) -> None:
        self.cache = None

    def free(self) -> None:
        self.cache = None

    def weights_loaded(self) -> None:
        pass  # every step is a fresh forward: it reads whatever the weights are now

    def nbytes(self) -> int:
        c = self.cache
        return (c.kda_nbytes() + c.mla_nbytes()) if c is not None else 0

    def stats(self, n: int) -> dict:
        c = self.cache
        return {"kda_bytes": c.kda_nbytes() if c else 0, "mla_bytes": c.mla_nbytes() if c else 0}


class StaticDecode(DecodeState):
    """Fixed-shape slots (``k3core.model.cache.StaticDecodeState``) padded to a bucket; with
    ``graphs`` each bucket's step is a captured CUDA graph (``k3core.rollout.decode_graphs``)."""

    def __init__(self, model: K3ForCausalLM, max_batch: int, graphs: bool = False):
        self.model, self.max_batch, self.use_graphs = model, max_batch, graphs
        self.mode = "graph" if graphs else "static"
        self.state: model_cache.StaticDecodeState | None = None  # allocated by the first admission
        self.graphs: DecodeGraphs | None = None  # belongs to ``state``; captured per bucket on first use

    def admit(self, prefilled: K3Cache, held: int, max_len: int) -> None:
        n = held + prefilled.batch_size
        self._fit(n, held, max_len)
        self.state.load(prefilled, list(range(held, n)))

    def _fit(self, n: int, held: int, need_len: int) -> None:
        """Make the slots hold ``n`` sequences of up to ``need_len`` tokens, keeping the first
        ``held``; new slots mean new graphs (a graph reads the old buffers' addresses)."""
        need_slots = bucket(n, self.max_batch)
        st = self.state
        if st is not None and st.slots >= need_slots and st.max_len >= need_len:
            return
        max_len = max(64, 1 << (need_len - 1).bit_length(), st.max_len if st else 0)
        slots = max(need_slots, st.slots if st else 0)
        if st is None:
            self.state = model_cache.StaticDecodeState(self.model.config, slots, max_len,
                                                       self.model.lm_head.weight.dtype, self.model.lm_head.weight.device)
        else:
            self.state = st.resized(slots, max_len, held)
        self.graphs = None

    def retire(self, keep: list[int]) -> list[int]:
        """Survivors take slots 0..n-1: those beyond move into the holes."""
        n = len(keep)
        kept = set(keep)
        order = list(range(n))
        holes = [j for j in range(n) if j not in kept]
        movers = [j for j in keep if j >= n]
        for h, m in zip(holes, movers):
            order[h] = m
        self.state.move(movers, holes)
        self.state.release(n)
        return order

    def row(self, j: int) -> K3Cache:
        return self.state.row(j)

    def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = tokens.shape[0]
        b = bucket(n, self.state.slots)
        self.state.tokens[:n].copy_(tokens)
        if self.use_graphs:
            if self.graphs is None:
                self.graphs = DecodeGraphs(self.model, self.state)
            logits, routing = self.graphs.replay(b)
        else:
            logits, routing = self.model.decode_step(self.state, b)
        out = at_least_fp32(logits[:n])
        if out.data_ptr() == logits.data_ptr():  # graph outputs are overwritten by the next replay
            out = out.clone()
        return out, routing[:n]

    def clear(self) -> None:
        if self.state is not None:
            self.state.release(0)

    def free(self) -> None:
        self.state, self.graphs = None, None

    def weights_loaded(self) -> None:
        if self.graphs is not None and self.graphs.weights_moved():
            self.graphs = None  # captured again on the next step, reading the new storage

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.buffers()) if self.state is not None else 0

    def stats(self, n: int) -> dict:
        if self.state is None:
            return {"kda_bytes": 0, "mla_bytes": 0}
        return self.state.stats(n)


def new_decode_state(mode: str, model: K3ForCausalLM, max_batch: int) -> DecodeState:
    """The decode state of a resolved ``mode`` ("dynamic", "static" or "graph")."""
    if mode == "dynamic":
        return DynamicDecode(model)
    if mode in ("static", "graph"):
        return StaticDecode(model, max_batch, graphs=mode == "graph")
    raise ValueError(f"no decode state for mode {mode!r}")
