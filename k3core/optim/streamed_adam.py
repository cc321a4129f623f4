"""StreamedAdamW: AdamW whose state lives on the host, updated in fixed-size chunks.

Owns: the host optimizer state (fp32 master weights, two bf16 moments), and each step's streaming
of gradients down to the host and updated weights back up. Does not own: the model, the loss, the
gradient reduce-scatter (FSDP2 does it), or where checkpoints are stored (torch.distributed.checkpoint).

Memory, for N parameter elements on this rank:
    device: weights [N] in their own dtype (bf16; fp32 for the few that must stay fp32, e.g. KDA
            A_log and dt_bias) and their gradients [N], exactly as without offload.
    host:   master fp32 [N] (4 B) + exp_avg bf16 [N] (2 B) + exp_avg_sq bf16 [N] (2 B) = 8 B/param,
            a 4-byte step counter per parameter tensor, and fixed chunk buffers independent of N:
            2 gradient stages + 2 weight stages [C] (pinned), 3 fp32 scratch tiles, a 4 MiB noise table.
    There is never a host gradient buffer of size N; the usual offload optimizers keep one
    (torchao CPUOffloadOptimizer, ZeRO-Offload, Megatron HybridDeviceOptimizer: 12 B/param).

One step (C = chunk_numel; chunks k = 0..K-1 cut from the parameters in order, see `_plan`):
    copy stream (D2H): gradient segments of chunk k+1 -> grad stage[(k+1) % 2]
    host:              wait for chunk k's gradients; then tile by tile (cache-sized pieces):
                       bf16 gradient and moments -> fp32 scratch; torch's fused CPU AdamW kernel on
                       the fp32 master; moments back to bf16 with stochastic rounding
                       (k3core.optim.stochastic_rounding says why); master -> weight dtype (round
                       to nearest) into weight stage[k % 2]
    copy stream (H2D): weight stage[k % 2] -> the device weights of chunk k
    Both copy directions overlap the host update of the neighbouring chunks (CUDA events order
    them); the compute stream waits for the last H2D copy before step() returns. Without a GPU the
    "device" tensors are ordinary CPU tensors and the same loop runs with plain copies.

Semantics equal torch.optim.AdamW (decoupled weight decay, bias correction, per-parameter step
counts, parameters without a gradient skipped) applied to fp32 master weights, after optional
global gradient-norm clipping as torch.nn.utils.clip_grad_norm_ does it; the device weights are
the master rounded to their dtype. The reference that tests hold this to is
``k3core.optim.naive.ReferenceHostAdamW``.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable

import torch

from k3core.optim import host_kernel as host_kernel_lib
from k3core.optim.host_arena import HostArena
from k3core.optim.stochastic_rounding import (
    NOISE_TABLE_NUMEL,
    make_noise_table,
    noise_offset,
    stochastic_round_to_bf16_,
)

try:  # DTensor (FSDP2 shards); absent on builds without torch.distributed
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None

_STATE_TENSORS = ("master", "exp_avg", "exp_avg_sq")


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameter or gradient), else the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def _flat(t: torch.Tensor) -> torch.Tensor:
    local = _local(t).detach()
    if not local.is_contiguous():
        raise ValueError(f"StreamedAdamW needs contiguous parameters and gradients, got strides {local.stride()}")
    return local.view(-1)


def _sum_of_squares_fp32(t: torch.Tensor, piece: int) -> torch.Tensor:
    """sum(t^2) accumulated in fp32, cast `piece` elements at a time: asking vector_norm for an
    fp32 result casts the whole tensor first (a full-size temporary), a bf16 result rounds the norm."""
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=t.device)
    for start in range(0, flat.numel(), piece):
        total += torch.linalg.vector_norm(flat[start : start + piece], dtype=torch.float32).square()
    return total


def global_grad_norm(grads: list[torch.Tensor], piece: int = 1 << 22) -> torch.Tensor:
    """L2 norm of all gradients together, accumulated in fp32 on their device: a 0-d tensor.

    DTensor gradients (FSDP2 shards) contribute their local shard, and the squared sums are
    all-reduced over every mesh dimension they are sharded on; replicated dimensions are not
    summed (that would count a shard twice). Partial placements are refused. Temporary memory:
    at most `piece` fp32 elements.
    """
    totals: list[tuple[Any, tuple[int, ...], torch.Tensor]] = []  # (mesh, sharded dims, sum of squares)
    for g in grads:
        local = _local(g)
        sq = _sum_of_squares_fp32(local, piece)
        mesh, dims = None, ()
        if _is_dtensor(g):
            for pl in g.placements:
                if not isinstance(pl, (Shard, Replicate)):
                    raise ValueError(f"gradient placement {pl} is not supported for clipping")
            mesh, dims = g.device_mesh, tuple(d for d, pl in enumerate(g.placements) if isinstance(pl, Shard))
        for i, (m, ds, acc) in enumerate(totals):
            if m is mesh and ds == dims and acc.device == sq.device:
                totals[i] = (m, ds, acc + sq)
                break
        else:
            totals.append((mesh, dims, sq))
    if not totals:
        return torch.zeros(())
    parts = []
    for mesh, dims, acc in totals:
        for d in dims:
            torch.distributed.all_reduce(acc, group=mesh.get_group(d))
        parts.append(acc.to(totals[0][2].device))
    return torch.stack(parts).sum().sqrt()


@dataclass
class _Segment:
    """Elements [start, end) of one flattened (local) parameter, at `offset` in its chunk."""

    index: int  # parameter index in the optimizer: the stochastic-rounding noise key
    param: torch.Tensor
    state: dict
    start: int
    end: int
    offset: int


@dataclass
class _Chunk:
    """At most chunk_numel elements from parameters of one group and one (weight, grad) dtype pair."""

    group: dict
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    segments: list[_Segment] = field(default_factory=list)
    numel: int = 0


class _ChunkTransport:
    """Moves chunk segments between the parameters' device and two host staging slots per direction.

    CUDA: copies run on two side streams (one per direction, PCIe is full duplex) into pinned
    stages; events say when a slot's gradients have landed and when a slot's weights have left.
    CPU: plain synchronous copies through the same stages.
    """

    def __init__(self, device: torch.device, grad_stages: list[HostArena], weight_stages: list[HostArena]):
        self.cuda = device.type == "cuda"
        self.device = device
        self.grad_stages, self.weight_stages = grad_stages, weight_stages
        self._grad_views: list[torch.Tensor | None] = [None, None]
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            self.grads_landed = [torch.cuda.Event(), torch.cuda.Event()]
            self.weights_left = [torch.cuda.Event(), torch.cuda.Event()]
        self._weights_in_flight = [False, False]

    def _side(self, stream) -> Any:
        return torch.cuda.stream(stream) if self.cuda else nullcontext()

    def begin(self) -> None:
        """Side streams start after everything queued so far (backward, the clipping norm)."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            self.d2h.wait_stream(current)
            self.h2d.wait_stream(current)

    def fetch_grads(self, chunk: _Chunk, slot: int) -> None:
        isz = chunk.grad_dtype.itemsize
        buf = self.grad_stages[slot].data[: chunk.numel * isz].view(chunk.grad_dtype)
        with self._side(self.d2h if self.cuda else None):
            for s in chunk.segments:
                buf[s.offset : s.offset + s.end - s.start].copy_(_flat(s.param.grad)[s.start : s.end], non_blocking=self.cuda)
            if self.cuda:
                self.grads_landed[slot].record(self.d2h)
        self._grad_views[slot] = buf

    def wait_grads(self, slot: int) -> torch.Tensor:
        if self.cuda:
            self.grads_landed[slot].synchronize()
        return self._grad_views[slot]

    def weight_slot(self, chunk: _Chunk, slot: int) -> torch.Tensor:
        """The weight stage to fill, once the H2D copy that last used it has finished."""
        if self._weights_in_flight[slot]:
            self.weights_left[slot].synchronize()
            self._weights_in_flight[slot] = False
        isz = chunk.param_dtype.itemsize
        return self.weight_stages[slot].data[: chunk.numel * isz].view(chunk.param_dtype)

    def push_weights(self, chunk: _Chunk, buf: torch.Tensor, slot: int) -> None:
        with self._side(self.h2d if self.cuda else None):
            for s in chunk.segments:
                _flat(s.param)[s.start : s.end].copy_(buf[s.offset : s.offset + s.end - s.start], non_blocking=self.cuda)
            if self.cuda:
                self.weights_left[slot].record(self.h2d)
                self._weights_in_flight[slot] = True

    def end(self) -> None:
        """Later work on the compute stream sees the new weights; stages are free for the next step."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.h2d)
            for slot in (0, 1):
                if self._weights_in_flight[slot]:
                    self.weights_left[slot].synchronize()
                    self._weights_in_flight[slot] = False


class StreamedAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and bf16 moments on the host, streamed in chunks.

    Args:
        params: parameters (or (name, parameter) pairs, or param-group dicts) of the device model,
            all on one device; DTensor parameters (FSDP2) are handled through their local shard.
            Their current values initialise the master weights. Weights keep their own dtype on
            the device: bf16 ones receive the master rounded to nearest, fp32 ones (KDA A_log,
            dt_bias, ...) the master itself.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled decay), per group.
        chunk_numel: elements per chunk C, the copy granularity; sets the pinned stages (8 B x C
            for bf16 weights and grads). Need not divide parameter sizes.
        tile_numel: elements the host updates at a time within a chunk (cache blocking); sets the
            fp32 scratch (12 B x tile). Any value gives the same result.
        max_grad_norm: clip the global gradient L2 norm to this (computed on the device before
            streaming, as clip_grad_norm_ with eps 1e-6); None disables. The unclipped norm is kept
            in `last_grad_norm`. A non-finite norm raises FloatingPointError and leaves state as is.
        moment_dtype: torch.bfloat16 (8 B/param of state) or torch.float32 (12 B/param; exact
            torch.optim.AdamW semantics, for comparisons).
        moment_rounding: "stochastic" (default) or "nearest" for bf16 moments.
        pin_memory: page-lock host state and stages; default: when the parameters are on CUDA.
        seed: seeds the stochastic-rounding noise table (saved in the state dict).
        host_kernel: how the host updates bf16 moments: "c" (``k3core.optim.host_kernel``: one pass
            per element, threaded), "torch" (tile by tile through torch ops and the fused AdamW
            kernel), or "auto" (default: "c" where a C compiler builds it, else "torch"). Both
            apply the same update (tests hold them to each other); fp32 moments always take "torch".
        host_threads: threads of the "c" kernel (default: torch.get_num_threads()).

    Parameters without a gradient at a step are skipped (no state change), as in torch. Param
    groups are fixed at construction: the host state is laid out once.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        chunk_numel: int = 1 << 22,
        tile_numel: int = 1 << 20,
        max_grad_norm: float | None = None,
        moment_dtype: torch.dtype = torch.bfloat16,
        moment_rounding: str = "stochastic",
        pin_memory: bool | None = None,
        seed: int = 0,
        host_kernel: str = "auto",
        host_threads: int | None = None,
    ) -> None:
        errors = []
        if not lr >= 0.0:
            errors.append(f"lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            errors.append(f"betas must lie in [0, 1), got {betas}")
        if not eps >= 0.0:
            errors.append(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            errors.append(f"weight_decay must be >= 0, got {weight_decay}")
        if chunk_numel < 1:
            errors.append(f"chunk_numel must be >= 1, got {chunk_numel}")
        if tile_numel < 1:
            errors.append(f"tile_numel must be >= 1, got {tile_numel}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            errors.append(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if moment_dtype not in (torch.bfloat16, torch.float32):
            errors.append(f"moment_dtype must be bfloat16 or float32, got {moment_dtype}")
        if moment_rounding not in ("stochastic", "nearest"):
            errors.append(f"moment_rounding must be 'stochastic' or 'nearest', got {moment_rounding!r}")
        if host_kernel not in ("auto", "c", "torch"):
            errors.append(f"host_kernel must be 'auto', 'c' or 'torch', got {host_kernel!r}")
        elif host_kernel == "c" and moment_dtype != torch.bfloat16:
            errors.append("host_kernel 'c' updates bf16 moments only: use moment_dtype=torch.bfloat16 or host_kernel='torch'")
        elif host_kernel == "c" and not host_kernel_lib.available():
            errors.append(f"host_kernel 'c' is unavailable: {host_kernel_lib.why_not()}; or pass host_kernel='torch'")
        if errors:
            raise ValueError("; ".join(errors))

        self._laid_out = False
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.chunk_numel = int(chunk_numel)
        self.max_grad_norm = max_grad_norm
        self.moment_dtype = moment_dtype
        self.moment_rounding = moment_rounding
        self.seed = int(seed)
        self.last_grad_norm: float | None = None

        self._params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        names = [n for g in self.param_groups for n in (g.get("param_names") or [])]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique")
        self._index = {p: i for i, p in enumerate(self._params)}

        devices = {_local(p).device for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        pin = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self._pin = pin

        total = self._numel = sum(_local(p).numel() for p in self._params)
        self._tile = max(1, min(int(tile_numel), self.chunk_numel, total))
        self._master_arena = HostArena(total, torch.float32, pin)
        self._exp_avg_arena = HostArena(total, moment_dtype, pin)
        self._exp_avg_sq_arena = HostArena(total, moment_dtype, pin)
        offset = 0
        for p in self._params:
            local = _local(p).detach()
            if not local.is_contiguous():
                raise ValueError("StreamedAdamW needs contiguous parameters")
            master = self._master_arena.view(offset, local.shape)
            master.copy_(local)
            self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "master": master,
                "exp_avg": self._exp_avg_arena.view(offset, local.shape),
                "exp_avg_sq": self._exp_avg_sq_arena.view(offset, local.shape),
            }
            offset += local.numel()

        self._stochastic = moment_dtype == torch.bfloat16 and moment_rounding == "stochastic"
        self._noise = make_noise_table(self.seed) if self._stochastic else None
        use_c = moment_dtype == torch.bfloat16 and (host_kernel == "c" or (host_kernel == "auto" and host_kernel_lib.available()))
        self._updater = host_kernel_lib.HostUpdater(host_threads) if use_c else None
        self._stage_itemsize = {"grad": 0, "weight": 0}
        self._grad_stages: list[HostArena] = []
        self._weight_stages: list[HostArena] = []
        self._scratch: dict[str, torch.Tensor] = {}
        self._transport: _ChunkTransport | None = None
        self._laid_out = True

    @property
    def host_kernel(self) -> str:
        """The host path this optimizer updates with: "c" or "torch"."""
        return "c" if self._updater is not None else "torch"

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_laid_out", False):
            raise NotImplementedError("StreamedAdamW lays out its host state once: pass every group to the constructor")
        super().add_param_group(param_group)

    # ---- one step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update of every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not work:
            return loss
        grad_scale = None
        if self.max_grad_norm is not None:
            piece = self.chunk_numel if self.device.type == "cuda" else self._tile  # bounds the fp32 temporary
            norm = float(global_grad_norm([p.grad for _, p in work], piece=piece))
            self.last_grad_norm = norm
            if not math.isfinite(norm):
                raise FloatingPointError(f"gradient norm is {norm}; step skipped")
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            if coef < 1.0:  # the fused kernel divides gradients by grad_scale
                grad_scale = torch.tensor(1.0 / coef, dtype=torch.float32)
        for _, p in work:
            self.state[p]["step"] += 1
        chunks = self._plan(work)
        if chunks:
            self._stream(chunks, grad_scale)
        return loss

    def _plan(self, work: list[tuple[dict, torch.Tensor]]) -> list[_Chunk]:
        """Cut the parameters with gradients into chunks of at most chunk_numel elements.

        Within each (group, weight dtype, grad dtype) bucket the parameters are laid end to end in
        their order and cut every chunk_numel elements, so one chunk may hold the tail of one
        parameter and the head of the next, and a large parameter spans several chunks.
        """
        buckets: dict[tuple[int, torch.dtype, torch.dtype], list[torch.Tensor]] = {}
        for g, p in work:
            local = _local(p)
            if local.numel() == 0:  # an FSDP rank may own no elements of a small parameter
                continue
            buckets.setdefault((id(g), local.dtype, _local(p.grad).dtype), []).append(p)
        groups = {id(g): g for g, _ in work}
        chunks: list[_Chunk] = []
        C = self.chunk_numel
        for (gid, pdt, gdt), params in buckets.items():
            current: _Chunk | None = None
            for p in params:
                if _local(p.grad).shape != _local(p).shape:
                    raise ValueError(f"gradient shape {tuple(_local(p.grad).shape)} != parameter shape {tuple(_local(p).shape)}")
                n, start = _local(p).numel(), 0
                while start < n:
                    if current is None or current.numel == C:
                        current = _Chunk(groups[gid], pdt, gdt)
                        chunks.append(current)
                    take = min(n - start, C - current.numel)
                    current.segments.append(_Segment(self._index[p], p, self.state[p], start, start + take, current.numel))
                    current.numel += take
                    start += take
        return chunks

    def _ensure_buffers(self, chunks: list[_Chunk]) -> None:
        """Allocate (or grow, if a wider dtype shows up) the fixed per-chunk buffers."""
        C = min(self.chunk_numel, self._numel)  # no chunk is larger than all the parameters
        gsz = max(c.grad_dtype.itemsize for c in chunks)
        wsz = max(c.param_dtype.itemsize for c in chunks)
        if gsz > self._stage_itemsize["grad"]:
            self._grad_stages = [HostArena(C * gsz, torch.uint8, self._pin) for _ in range(2)]
            self._stage_itemsize["grad"] = gsz
            self._transport = None
        if wsz > self._stage_itemsize["weight"]:
            self._weight_stages = [HostArena(C * wsz, torch.uint8, self._pin) for _ in range(2)]
            self._stage_itemsize["weight"] = wsz
            self._transport = None
        if not self._scratch and self._updater is None:  # the C kernel needs no scratch
            names = ("grad",) if self.moment_dtype == torch.float32 else ("grad", "exp_avg", "exp_avg_sq")
            self._scratch = {k: torch.empty(self._tile, dtype=torch.float32) for k in names}
        if self._transport is None:
            self._transport = _ChunkTransport(self.device, self._grad_stages, self._weight_stages)

    def _stream(self, chunks: list[_Chunk], grad_scale: torch.Tensor | None) -> None:
        self._ensure_buffers(chunks)
        io = self._transport
        io.begin()
        io.fetch_grads(chunks[0], 0)
        for k, chunk in enumerate(chunks):
            slot = k % 2
            if k + 1 < len(chunks):  # its slot was emptied by the host update of chunk k-1
                io.fetch_grads(chunks[k + 1], 1 - slot)
            grads = io.wait_grads(slot)
            weights = io.weight_slot(chunk, slot)
            self._update_chunk(chunk, grads, weights, grad_scale)
            io.push_weights(chunk, weights, slot)
        io.end()

    def _tiles(self, chunk: _Chunk):
        """Yield (a, b, segments of chunk elements [a, b) with offsets relative to a), b - a <= tile.

        Why tiles: the host update makes about a dozen elementwise passes (unpack, fused kernel,
        rounding, write-back); over a tile that fits in cache only the first read and last write
        of each array reach DRAM (benchmarks/streamed_adam.py sweeps the tile size).
        """
        T = self._tile
        segs = chunk.segments
        i = 0
        for a in range(0, chunk.numel, T):
            b = min(a + T, chunk.numel)
            out = []
            while i < len(segs) and segs[i].offset < b:
                s = segs[i]
                lo, hi = max(s.offset, a), min(s.offset + s.end - s.start, b)
                out.append(_Segment(s.index, s.param, s.state, s.start + lo - s.offset, s.start + hi - s.offset, lo - a))
                if s.offset + s.end - s.start <= b:
                    i += 1
                else:
                    break
            yield a, b, out

    def _update_chunk(
        self, chunk: _Chunk, grads: torch.Tensor, weights: torch.Tensor, grad_scale: torch.Tensor | None
    ) -> None:
        if self._updater is not None:
            self._update_chunk_c(chunk, grads, weights, grad_scale)
        else:
            self._update_chunk_torch(chunk, grads, weights, grad_scale)

    def _update_chunk_c(
        self, chunk: _Chunk, grads: torch.Tensor, weights: torch.Tensor, grad_scale: torch.Tensor | None
    ) -> None:
        """The whole chunk in one threaded pass of the C kernel. Runs are cut where either
        moment's noise slice wraps around the table, so each run reads contiguous draws."""
        group = chunk.group
        beta1, beta2 = group["betas"]
        scale = None if grad_scale is None else float(grad_scale)
        T = NOISE_TABLE_NUMEL
        runs = []
        for s in chunk.segments:
            st, step = s.state, int(s.state["step"])
            coef = host_kernel_lib.coefficients(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                                                float(group["weight_decay"]), step, scale)
            views = (st["master"].view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1))
            n = s.end - s.start
            if self._stochastic:
                pm = (noise_offset(self.seed, s.index, step, 0) + s.start) % T
                pv = (noise_offset(self.seed, s.index, step, 1) + s.start) % T
            j = 0
            while j < n:
                take = n - j
                if self._stochastic:
                    take = min(take, T - (pm + j) % T, T - (pv + j) % T)
                a, b = s.start + j, s.start + j + take
                o = s.offset + j
                noise = (self._noise, (pm + j) % T, (pv + j) % T) if self._stochastic else (None, 0, 0)
                runs.append((views[0][a:b], views[1][a:b], views[2][a:b], grads[o:o + take], weights[o:o + take],
                             coef, *noise))
                j += take
        self._updater.run(runs)

    def _update_chunk_torch(
        self, chunk: _Chunk, grads: torch.Tensor, weights: torch.Tensor, grad_scale: torch.Tensor | None
    ) -> None:
        """AdamW on the host for one chunk, tile by tile: grads [n] staged in the gradient dtype;
        weights [n] (the weight stage, in the weight dtype) receives the updated masters."""
        for a, b, segs in self._tiles(chunk):
            if grads.dtype == torch.float32:
                g32 = grads[a:b]  # the kernel may unscale it in place: a stage, refilled next time
            else:
                g32 = self._scratch["grad"][: b - a]
                g32.copy_(grads[a:b])
            gs = [g32[s.offset : s.offset + s.end - s.start] for s in segs]
            self._adamw_segments(chunk.group, segs, gs, grad_scale)
            for s in segs:
                weights[a + s.offset : a + s.offset + s.end - s.start].copy_(s.state["master"].view(-1)[s.start : s.end])

    def _adamw_segments(
        self, group: dict, segs: list[_Segment], gs: list[torch.Tensor], grad_scale: torch.Tensor | None
    ) -> None:
        """Fused AdamW of segments (at most one tile) given their fp32 gradients gs (clobbered);
        bf16 moments go through the fp32 scratch and back with the configured rounding."""
        masters = [s.state["master"].view(-1)[s.start : s.end] for s in segs]
        if self.moment_dtype == torch.float32:
            ms = [s.state["exp_avg"].view(-1)[s.start : s.end] for s in segs]
            vs = [s.state["exp_avg_sq"].view(-1)[s.start : s.end] for s in segs]
        else:
            m32, v32 = self._scratch["exp_avg"], self._scratch["exp_avg_sq"]
            ms = [m32[s.offset : s.offset + s.end - s.start] for s in segs]
            vs = [v32[s.offset : s.offset + s.end - s.start] for s in segs]
            for s, m, v in zip(segs, ms, vs):
                m.copy_(s.state["exp_avg"].view(-1)[s.start : s.end])
                v.copy_(s.state["exp_avg_sq"].view(-1)[s.start : s.end])
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            masters, gs, ms, vs, [], [s.state["step"] for s in segs],
            lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
            weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
            amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None,
        )  # fmt: skip
        if self.moment_dtype == torch.float32:
            return
        for s, m, v in zip(segs, ms, vs):
            dst_m = s.state["exp_avg"].view(-1)[s.start : s.end]
            dst_v = s.state["exp_avg_sq"].view(-1)[s.start : s.end]
            if self._stochastic:
                step = int(s.state["step"])
                stochastic_round_to_bf16_(m, dst_m, self._noise, noise_offset(self.seed, s.index, step, 0), s.start)
                stochastic_round_to_bf16_(v, dst_v, self._noise, noise_offset(self.seed, s.index, step, 1), s.start)
            else:
                dst_m.copy_(m)
                dst_v.copy_(v)

    # ---- state dict (torch.distributed.checkpoint) -------------------------------------------

    def _as_saved(self, p: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Host state of a DTensor parameter as a DTensor with the parameter's layout, so DCP
        saves a global tensor and can reshard it; the local tensor is the host state itself."""
        if not _is_dtensor(p):
            return host
        return DTensor.from_local(
            host, device_mesh=p.device_mesh, placements=p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state-dict layout, holding plain (or DTensor) tensors, for DCP.

        {"state": {i: {"step": [], "master": fp32 [shape], "exp_avg": [shape], "exp_avg_sq": [shape]}},
         "param_groups": [{"lr", "betas", "eps", "weight_decay", ..., "params": [i, ...]}],
         "config": {"moment_dtype": str, "seed": int}}
        with i the parameter's position in the optimizer (groups in order), as in
        torch.optim.Optimizer, so both dcp.save(opt.state_dict()) and the FQN-keyed
        torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict work. The tensors
        ARE the host state (no copies): dcp.load into this dict writes the state in place; call
        load_state_dict afterwards to push the masters to the device. For DTensor parameters
        (FSDP2) the state is a DTensor with the parameter's layout, so DCP saves global tensors.
        """
        state = {}
        for i, p in enumerate(self._params):
            st = self.state[p]
            state[i] = {"step": st["step"]} | {k: self._as_saved(p, st[k]) for k in _STATE_TENSORS}
        groups = []
        for g in self.param_groups:
            saved = {k: v for k, v in g.items() if k != "params"}
            saved["params"] = [self._index[p] for p in g["params"]]
            groups.append(saved)
        config = {"moment_dtype": str(self.moment_dtype), "seed": self.seed}
        return {"state": state, "param_groups": groups, "config": config}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore host state and hyperparameters, then set the device weights from the masters.

        Saved entries are matched to parameters by position in the param groups, whatever their
        keys (indices from state_dict(), FQNs from get_state_dict); saved "param_names", when both
        sides have them, must agree. The master weights are the source of truth: after loading,
        every device weight equals its master rounded to the weight's dtype.
        """
        errors = []
        config = state_dict.get("config", {})
        if config.get("moment_dtype", str(self.moment_dtype)) != str(self.moment_dtype):
            errors.append(f"moment_dtype {config['moment_dtype']} != {self.moment_dtype}")
        groups = state_dict["param_groups"]
        pairs = []  # (saved key, parameter)
        if len(groups) != len(self.param_groups):
            errors.append(f"{len(groups)} param groups saved, {len(self.param_groups)} here")
        for i, (saved, g) in enumerate(zip(groups, self.param_groups)):
            names_saved, names_here = saved.get("param_names"), g.get("param_names")
            if len(saved["params"]) != len(g["params"]):
                errors.append(f"param group {i}: {len(saved['params'])} parameters saved, {len(g['params'])} here")
            elif names_saved is not None and names_here is not None and list(names_saved) != list(names_here):
                errors.append(f"param group {i}: saved parameter names differ from this optimizer's")
            pairs += list(zip(saved["params"], g["params"]))
        for key, p in pairs:
            saved = state_dict["state"].get(key)
            if saved is None:
                errors.append(f"no state for parameter {key!r}")
                continue
            for k in _STATE_TENSORS:
                if _local(saved[k]).shape != self.state[p][k].shape:
                    errors.append(f"{key}.{k}: shape {tuple(_local(saved[k]).shape)} != {tuple(self.state[p][k].shape)}")
        if errors:
            raise ValueError("cannot load optimizer state: " + "; ".join(errors))

        for key, p in pairs:
            saved, st = state_dict["state"][key], self.state[p]
            st["step"].copy_(saved["step"])
            for k in _STATE_TENSORS:
                src = _local(saved[k])
                if src.data_ptr() != st[k].data_ptr():
                    st[k].copy_(src)
        for saved, g in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k not in ("params", "param_names"):
                    g[k] = tuple(v) if k == "betas" else v
        self.seed = int(config.get("seed", self.seed))
        if self._stochastic:
            self._noise = make_noise_table(self.seed)
        for p in self._params:
            _local(p).detach().copy_(self.state[p]["master"])

    # ---- accounting ----------------------------------------------------------------------------

    def host_bytes(self) -> dict[str, int]:
        """Host bytes held: "state" (master + moments, 8 B/param with bf16 moments), "steps" (one
        fp32 scalar per parameter tensor), "buffers" (chunk stages, scratch, noise table: fixed in N)."""
        state = self._master_arena.nbytes + self._exp_avg_arena.nbytes + self._exp_avg_sq_arena.nbytes
        buffers = sum(a.nbytes for a in self._grad_stages + self._weight_stages)
        buffers += sum(t.numel() * t.element_size() for t in self._scratch.values())
        if self._noise is not None:
            buffers += self._noise.numel() * self._noise.element_size()
        return {"state": state, "steps": 4 * len(self._params), "buffers": buffers}

    def pinned_bytes(self) -> int:
        """Bytes of host memory page-locked by this optimizer (state and stages when pinned; each
        arena rounded up to whole pages)."""
        arenas = [self._master_arena, self._exp_avg_arena, self._exp_avg_sq_arena, *self._grad_stages, *self._weight_stages]
        return sum(a.pinned_nbytes for a in arenas)

