"""Graph mode's data flow on CPU: the engine's real ``DecodeGraphs`` (warm-up, restore, capture,
replay per bucket) over a capture that records aten ops instead of a CUDA graph, against "static".

A CUDA graph stores addresses: on replay every op reads the tensors it read at capture time. The
emulation does the same: during "capture" every op is recorded with its arguments (the tensor
objects) and its outputs; what ops wrote in place is restored afterwards (a capture runs nothing);
"replay" re-runs the recorded ops and copies each result into the capture-time output. So an input
that the engine writes into storage the captured step does not read (a copy made outside the
capture, a replaced buffer) makes replay differ from the eager step. What it does not model: the
CUDA kernels themselves (fla, ``torch._grouped_mm``, Triton SiTU), streams and memory-pool reuse.
"""

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import k3core.rollout.decode_graphs as decode_graphs
import k3core.rollout.decode_state as decode_state
import k3core.rollout.engine as engine_module
from k3core.rollout.engine import RolloutEngine

from tests.k3core.rollout.test_engine_batching import _greedy_then_reload, _model, _prompts


class _Recorder(TorchDispatchMode):
    """Records (op, args, kwargs, outputs); saves every tensor an op writes in place, to restore."""

    def __init__(self, ops: list):
        super().__init__()
        self.ops, self.written = ops, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                t = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(t, torch.Tensor):
                    self.written.append((t, t.clone()))
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class _RecordedGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: ``replay`` re-runs the recorded ops on the recorded tensors."""

    def __init__(self):
        self.ops: list = []

    @torch.no_grad()
    def replay(self):
        for func, args, kwargs, out in self.ops:
            res = func(*args, **kwargs)
            for o, r in zip(tree_flatten(out)[0], tree_flatten(res)[0]):
                same = isinstance(r, torch.Tensor) and o.data_ptr() == r.data_ptr() and o.stride() == r.stride()
                if isinstance(o, torch.Tensor) and not same:  # in-place ops and views already wrote o
                    o.copy_(r)


@contextlib.contextmanager
def _record(graph, pool=None, capture_error_mode=None):
    rec = _Recorder(graph.ops)
    with rec:
        yield
    with torch.no_grad():  # a capture runs nothing: undo what the recorded ops wrote
        for t, before in reversed(rec.written):
            t.copy_(before)


class _Stream:
    def wait_stream(self, other):
        pass


class _CPUDecodeGraphs(decode_graphs.DecodeGraphs):
    def __init__(self, model, state):  # the parent refuses a CPU state; nothing else differs
        self.model, self.state, self.pool, self.graphs = model, state, None, {}
        self.pointers = decode_graphs.weight_pointers(model)


@pytest.fixture
def emulated_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", _record)
    monkeypatch.setattr(decode_state, "DecodeGraphs", _CPUDecodeGraphs)
    # "graph" is refused on CPU at construction; the emulation stands in for CUDA
    monkeypatch.setattr(engine_module, "resolve_decode", lambda model, decode: decode)


def _run(model, mode, new_weights, prompts, budgets):
    eng = RolloutEngine(copy.deepcopy(model), max_batch=4, record_logits=True, decode=mode)
    assert eng.decode_mode == mode
    return [c for run in _greedy_then_reload(eng, prompts, budgets, new_weights) for c in run], eng


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_graph_mode_equals_static_with_joins_leaves_and_a_weight_update(emulated_graphs, dtype):
    """The GPU engine test's schedule (seven requests through max_batch 4, then load_weights and the
    same requests again) in graph mode over the recording capture and in static mode: the same ops
    on the same values, so every sampled-from logits row and every token is bitwise equal."""
    base = _model(4, dtype)
    new = _model(5, dtype).state_dict()
    lens, budgets = [6, 3, 40, 1, 12, 25, 2], [9, 24, 30, 8, 3, 12, 6]
    prompts = _prompts(lens, seed=6)
    graph, eng = _run(base, "graph", new, prompts, budgets)
    static, _ = _run(base, "static", new, prompts, budgets)
    assert eng._decode.graphs is not None and set(eng._decode.graphs.graphs) == {1, 2, 4}  # every bucket was captured
    for g, s in zip(graph, static):
        n = min(len(g.output_ids), len(s.output_ids))
        gap = float((g.meta["logits"][:n] - s.meta["logits"][:n]).abs().max())
        assert torch.equal(g.meta["logits"], s.meta["logits"]), \
            f"prompt of {len(g.prompt_ids)}, weight version {g.weight_version}: max |logit diff| {gap:.3g}"
        assert g.output_ids == s.output_ids and torch.equal(g.routing, s.routing)
