"""The static-shape decode path (what CUDA graphs capture), eagerly on CPU: the same logits and routing
as the dynamic path and as the uncached full forward under continuous batching (joins, leaves, slot
moves, padding up to a bucket, state growth); no host sync in ``decode_step``; weight-derived caches
keep their storage across weight updates (a captured graph reads addresses)."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3core.model import K3Cache
from k3core.model.cache import StaticDecodeState
from k3core.rollout.engine import RolloutEngine, SamplingParams

from tests.k3core.rollout.test_engine_batching import TINY, _model, _prompts

# every way a device value reaches the host, or an output shape depends on data
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::bincount", "aten::masked_select",
            "aten::unique", "aten::_unique2", "aten::equal", "aten::is_nonzero")


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _run(model, decode, schedule):
    """schedule: list of (prompt, SamplingParams) batches; each batch is submitted after two steps
    of the previous one. -> completions keyed by (prompt tuple, sample index), and the engine."""
    eng = RolloutEngine(model, max_batch=4, record_logits=True, decode=decode)
    futures = []
    for reqs in schedule:
        futures += [eng.submit(p, sp) for p, sp in reqs]
        eng.step()
        eng.step()
    while eng.step():
        pass
    return {(tuple(c.prompt_ids), c.sample_index): c for f in futures for c in f.result()}, eng


def test_static_decode_equals_dynamic_and_full_forward_with_joins_and_leaves():
    """fp64, max_batch 4: one request alone first (1 slot), then six more of lengths 1..40 with
    different budgets (one with n=2): slots grow 1 -> 4, batches of 3 pad to 4, leaves move the
    last slots into holes, a 40-token prompt + 30 new tokens grows the latent length past 64.
    Every sampled-from logits row equals the dynamic path's and the uncached forward's (1e-10)."""
    model = _model(5)
    ref = copy.deepcopy(model)
    lens, budgets = [6, 3, 9, 1, 40, 12, 2], [9, 5, 2, 8, 30, 3, 6]
    reqs = [(p, SamplingParams(max_new_tokens=k, temperature=0.8, seed=i, n=1 + (i == 3)))
            for i, (p, k) in enumerate(zip(_prompts(lens, seed=7), budgets))]
    schedule = [reqs[:1], reqs[1:]]
    dyn, _ = _run(copy.deepcopy(model), "dynamic", schedule)
    sta, eng = _run(model, "static", schedule)
    assert eng.decode_mode == "static" and eng._decode.state.slots == 4 and eng._decode.state.max_len == 128
    assert sorted(dyn) == sorted(sta) and len(sta) == 8
    for key, c in sta.items():
        d = dyn[key]
        assert c.output_ids == d.output_ids and torch.equal(c.routing, d.routing)
        torch.testing.assert_close(c.meta["logits"], d.meta["logits"], rtol=0, atol=1e-10)
        with torch.no_grad():
            out = ref(torch.tensor([c.prompt_ids + c.output_ids[:-1]]), return_routing=True)
        P = len(c.prompt_ids)
        torch.testing.assert_close(c.meta["logits"], out.logits[0, P - 1:], rtol=0, atol=1e-10)
        assert torch.equal(c.routing, out.routing[0].to(torch.int16))
    # the schedule really joined mid-decode and left out of slot order
    assert any(c.meta["admitted_step"] > 0 for c in sta.values())
    assert len({c.meta["finished_step"] for c in sta.values()}) > 3


def _prefilled_state(model, prompts, slots, max_len):
    """A static state whose first len(prompts) slots hold the prefilled prompts (left-padded batch)."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts])
    cache = K3Cache.empty(model.config)
    with torch.no_grad():
        model(ids, mask, cache=cache)
    st = StaticDecodeState(model.config, slots, max_len, model.lm_head.weight.dtype, "cpu")
    st.load(cache, list(range(len(prompts))))
    return st, cache


def test_padding_slots_do_not_change_real_rows():
    """Two sequences decoded in a 4-slot bucket (slots 2, 3 stale padding) equal the same two decoded
    as a bucket of 2, step after step."""
    model = _model(6)
    model.use_inference_caches = True
    model.refresh_inference_caches()
    prompts = _prompts([5, 9], seed=3)
    a, _ = _prefilled_state(model, prompts, 4, 64)
    b, _ = _prefilled_state(model, prompts, 2, 64)
    a.tokens[2:] = torch.tensor([11, 200])
    a.lens[2] = 63  # a padding slot at the end of the buffer: its writes clamp in bounds
    for step in range(5):
        tok = torch.tensor([3 + step, 100 + step])
        a.tokens[:2] = tok
        b.tokens[:2] = tok
        la, ra = model.decode_step(a, 4)
        lb, rb = model.decode_step(b, 2)
        torch.testing.assert_close(la[:2], lb, rtol=0, atol=1e-12)
        assert torch.equal(ra[:2], rb)
    assert a.lens[:2].tolist() == [10, 14] and int(a.lens[2]) == 68


def test_decode_step_has_no_host_sync():
    """On the meta device nothing can be read back (``.item()``, ``.tolist()``, data-dependent shapes
    all raise), so a completed ``decode_step`` there reads no device value on the host; on CPU it
    calls none of the syncing ops. The same recorder does see the dynamic path's syncs."""
    model = _model(7, torch.float32)
    model.use_inference_caches = True
    model.refresh_inference_caches()
    st, cache = _prefilled_state(model, _prompts([4, 7, 2], seed=4), 4, 64)
    with OpRecorder() as rec:
        logits, routing = model.decode_step(st, 4)
    assert logits.shape == (4, TINY.vocab_size) and routing.shape == (4, 3, TINY.num_experts_per_token)
    assert rec.ops and not set(rec.ops) & set(SYNC_OPS)
    with OpRecorder() as rec_dyn, torch.no_grad():
        model(torch.tensor([[1], [2], [3]]), cache=cache)
    assert set(rec_dyn.ops) & set(SYNC_OPS)  # the recorder can fail: the dynamic step syncs

    meta = copy.deepcopy(model).to("meta")
    meta.refresh_inference_caches()
    st_meta = StaticDecodeState(TINY, 4, 64, torch.float32, "meta")
    logits, routing = meta.decode_step(st_meta, 4)
    assert logits.device.type == "meta" and logits.shape == (4, TINY.vocab_size)
    with pytest.raises(RuntimeError):  # what a sync would hit
        st_meta.lens.sum().item()


def test_weight_update_keeps_inference_cache_storage():
    """A captured graph reads addresses: after load_weights every parameter and every AttnRes
    w*gamma cache keeps its storage and holds the new values."""
    model = _model(8)
    eng = RolloutEngine(model, decode="static")
    sites = [m for n, m in model.named_modules() if n.endswith("_site")]
    before = {id(s): s.cache.data_ptr() for s in sites}
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    new = _model(9).state_dict()
    eng.load_weights(new, 1)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params
    assert {id(s): s.cache.data_ptr() for s in sites} == before
    layer = model.model.layers[1]
    want = new["model.layers.1.mlp_res_proj.weight"][0] * new["model.layers.1.mlp_res_norm.weight"]
    assert torch.equal(layer._mlp_site.cache, want)


def test_decode_mode_is_checked():
    model = _model(0, torch.float32)
    assert RolloutEngine(model).decode_mode == "dynamic"  # the engine's default mode
    assert RolloutEngine(model, decode="static").decode_mode == "static"
    with pytest.raises(ValueError, match="needs a CUDA model"):
        RolloutEngine(model, decode="graph")
    with pytest.raises(ValueError, match="decode must be one of"):
        RolloutEngine(model, decode="fast")
