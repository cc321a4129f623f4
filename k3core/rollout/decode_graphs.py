"""CUDA graphs of the engine's decode step: one captured ``K3ForCausalLM.decode_step`` per batch bucket.

Owns: capturing and replaying ``decode_step`` over one ``StaticDecodeState`` (``DecodeGraphs``) and
the bucket sizes (``bucket``). Does not own: the decode state (``k3core.model.cache``), which
sequence sits in which slot and when graphs are made or dropped (``k3core.rollout.decode_state``),
sampling (``k3core.rollout.sampling``).

A decode step is a few thousand small kernels; launched one by one from Python it is host-bound:
the launches take far longer than reading the weights (docs/results/rollout_decode.md). A captured
graph replays them with one launch. A graph stores addresses, not tensors, so everything it reads must keep its storage:
- the decode state's buffers (fixed for the life of one ``StaticDecodeState``; a resized state gets
  new graphs);
- the weights: ``RolloutEngine.load_weights`` copies into the existing parameters and
  ``refresh_inference_caches`` overwrites the AttnRes ``w * gamma`` caches in place; the absorbed
  MLA matrices are views of ``kv_b_proj``. ``weights_moved`` tells when storage did move anyway
  (e.g. ``model.cast``), and the decode state then captures again;
- the input ids (``state.tokens``) and the outputs (held here per bucket; overwritten by the next
  replay of that bucket, so the caller copies what it keeps).

Capture follows the PyTorch recipe: warm-up forwards on a side stream (cuBLAS workspaces, Triton
autotuning), then ``torch.cuda.graph`` with one memory pool shared by every bucket (graphs replay
one at a time on one stream, and each bucket's outputs stay referenced here). The warm-up forwards
really run, and a decode step advances the state, so the slots are saved before and restored after.
"""

from __future__ import annotations

import torch

from k3core.model.cache import StaticDecodeState

WARMUP_STEPS = 2


class GraphCaptureError(RuntimeError):
    """Capturing failed; nothing ran, so the decode state is as it was before the step."""


def bucket(n: int, limit: int) -> int:
    """Padded batch for ``n`` sequences: the next power of two, at most ``limit`` (>= n)."""
    if not 1 <= n <= limit:
        raise ValueError(f"batch {n} is outside [1, {limit}]")
    return min(1 << (n - 1).bit_length(), limit)


def weight_pointers(model: torch.nn.Module) -> tuple[int, ...]:
    """Storage addresses of every parameter and buffer (a graph reads these addresses)."""
    return tuple(t.data_ptr() for t in list(model.parameters()) + list(model.buffers()) if t is not None)


class DecodeGraphs:
    """Captured ``model.decode_step(state, b)`` for each bucket ``b``, captured on first use."""

    def __init__(self, model, state: StaticDecodeState):
        if state.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA decode state, got {state.device}")
        self.model, self.state = model, state
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pointers = weight_pointers(model)

    def weights_moved(self) -> bool:
        return weight_pointers(self.model) != self.pointers

    @torch.no_grad()
    def _capture(self, b: int) -> None:
        saved = [t[:b].clone() for t in self.state.buffers()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.model.decode_step(self.state, b)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self.state.buffers(), saved):
            t[:b].copy_(s)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a server thread touching CUDA during a capture must not invalidate it
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits, routing = self.model.decode_step(self.state, b)
        except Exception as e:  # nothing ran during the capture: the state is as before the step
            raise GraphCaptureError(f"capturing the decode step of bucket {b} failed: {type(e).__name__}: {e}") from e
        self.graphs[b] = (graph, logits, routing)

    def replay(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of the first ``b`` slots (ids in ``state.tokens[:b]``) -> the bucket's
        output buffers (logits ``[b, V]``, routed ids ``[b, n_moe, k]``), valid until its next replay."""
        if b not in self.graphs:
            self._capture(b)
        graph, logits, routing = self.graphs[b]
        graph.replay()
        return logits, routing
