"""CUDA graphs of the decode step against the same step run eagerly (skipped without a GPU).

    python3 -m pytest -v -m gpu tests/k3core/rollout/test_cuda_graph_decode.py
"""

import copy

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3Cache, K3ForCausalLM
from k3core.model.cache import StaticDecodeState
from k3core.rollout.decode_graphs import DecodeGraphs
from k3core.rollout.agreement import greedy_agreement, greedy_outputs
from k3core.rollout.engine import RolloutEngine, SamplingParams
from tests.k3core.rollout.test_engine_batching import _greedy_then_reload
from tests.k3core.rollout.warmed import reverse_prompts, warmed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = K3Config.preset("small")
# fp32: fla's Triton kernels take fp32 dot products in TF32, and a replayed graph may run other
# autotuned configs than the eager call: measured on the H200, graph vs eager first-step logits
# differ by up to 2.6e-4 (logits of order 1), so the bound is TF32-level, not fp32-level.
# bf16: rounding of bf16 activations (about 4e-3 relative) through 8 layers, on logits of order 3.
TOL = {torch.float32: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=5e-2, atol=1e-1)}
# On random weights the router's top-k is a near-tie for many tokens: rounding noise flips experts
# and the logits move by O(1) (measured on the H200: two *eager* static states stepped identically
# differed by up to 2.24 on logits of magnitude ~3, and the engine test's modes first parted on
# routing at a prompt position in fp32). The tests that compare modes therefore take a router with
# clear margins (``_separate_routing``), so what they compare is the decode state, not near-ties;
# the model tests (tests/k3core/model/test_model_gpu.py) cover free routing by replaying it.
EQUALITY_DTYPES = [torch.float32, torch.bfloat16]


def _separate_routing(model):
    """A router with clear margins: ``e_score_correction_bias = -2 * arange(E)`` in every MoE layer.
    Selection is top-k of sigmoid scores (in (0, 1)) plus the bias, so the first k experts of the
    first groups win with a margin of at least 1 whatever the rounding, while the expert *weights*
    still follow each token's own scores. Returns the model."""
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(-2.0 * torch.arange(buf.numel(), dtype=buf.dtype, device=buf.device))
    return model


def _model(seed, dtype, separated=False):
    torch.manual_seed(seed)
    m = K3ForCausalLM(SMALL)
    m.reset_parameters(seed)
    with torch.no_grad():  # AttnRes w starts at 0: perturb every weight so every path matters
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if separated:
        _separate_routing(m)
    m = m.cuda().cast(dtype).eval()
    m.use_inference_caches = True
    m.refresh_inference_caches()
    return m


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _prefilled(model, prompts, slots, max_len):
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts], device="cuda")
    cache = K3Cache.empty(model.config)
    with torch.no_grad():
        logits = model(ids, mask, cache=cache).logits[:, -1]
    st = StaticDecodeState(model.config, slots, max_len, model.lm_head.weight.dtype, "cuda")
    st.load(cache, list(range(len(prompts))))
    return st, logits.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_decode_step_does_not_sync(dtype):
    """The step a graph captures makes no host sync (fla decode kernel, grouped experts, sampling-free)."""
    model = _model(0, dtype)
    st, tok = _prefilled(model, _prompts([5, 17, 9]), 4, 64)
    st.tokens[:3] = tok
    model.decode_step(st, 4)  # first call: Triton autotuning may sync, outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.decode_step(st, 4)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32])
def test_graph_replay_equals_eager_static_decode_across_a_weight_swap(dtype):
    """Two identical static states, one stepped eagerly and one by graph replay, fed the same tokens
    for 40 steps (3 sequences padded to a bucket of 4); after step 20 new weights are copied into the
    model as load_weights does (in place, caches refreshed in place). The replayed graph must follow
    the eager step, and the swap must show (a third state stepped by the old model differs)."""
    model = _model(1, dtype)
    old = copy.deepcopy(model)
    new_state = _model(2, dtype).state_dict()
    prompts = _prompts([5, 31, 12], seed=3)
    eager, tok = _prefilled(model, prompts, 4, 64)
    graphed, _ = _prefilled(model, prompts, 4, 64)
    stale, _ = _prefilled(model, prompts, 4, 64)
    graphs = DecodeGraphs(model, graphed)
    for step in range(40):
        if step == 20:
            with torch.no_grad():
                own = model.state_dict(keep_vars=True)
                for k, t in new_state.items():
                    own[k].copy_(t)
            model.refresh_inference_caches()
            assert not graphs.weights_moved()
        for st in (eager, graphed, stale):
            st.tokens[:3] = tok
        want, want_r = model.decode_step(eager, 4)
        got, got_r = graphs.replay(4)
        torch.testing.assert_close(got[:3].float(), want[:3].float(), **TOL[dtype], msg=lambda m: f"step {step}: {m}")
        assert torch.equal(got_r[:3], want_r[:3]) or dtype == torch.bfloat16
        before, _ = old.decode_step(stale, 4)
        if step >= 20:
            assert (before[:3].float() - want[:3].float()).abs().max() > 1e-2  # the swap is visible
        tok = want[:3].argmax(-1)
    assert list(graphs.graphs) == [4]


# The bf16 engine test once failed in graph mode only (logits off by up to 4.05 with routing equal,
# docs/results/gpu_tests.md). These variants replay the captured step against the eager static step
# in bf16 with each CUDA-only kernel of the step swapped for its torch path in turn, so a failure
# names the kernel that does not survive capture.
def _padded_experts(monkeypatch):
    import k3core.model.moe as moe
    monkeypatch.setattr(moe, "_grouped_mm_ok", lambda x, w: False)


def _torch_situ(monkeypatch):
    import functools

    import k3core.model.mlp as mlp
    import k3core.model.moe as moe
    from k3core.ops.situ import situ_glu
    for mod in (mlp, moe):
        monkeypatch.setattr(mod, "situ_glu", functools.partial(situ_glu, backend="torch"))


def _torch_kda_step(monkeypatch):
    import functools

    import k3core.model.kda as kda_module
    from k3core.ops.kda import kda_step
    monkeypatch.setattr(kda_module, "kda_step", functools.partial(kda_step, backend="torch"))


BF16_GRAPH_VARIANTS = {"as-shipped": [], "padded-experts": [_padded_experts], "torch-situ": [_torch_situ],
                       "torch-kda-step": [_torch_kda_step],
                       "all-torch": [_padded_experts, _torch_situ, _torch_kda_step]}


@pytest.mark.parametrize("variant", list(BF16_GRAPH_VARIANTS))
def test_graph_replay_equals_eager_static_decode_bf16(variant, monkeypatch):
    """bf16, a router with clear margins: a replayed graph and the eager static step run the same
    kernels on the same inputs, so over 12 steps (3 sequences padded to a bucket of 4, then a bucket
    of 2 captured into the same pool) their logits agree to bf16 rounding and their routing exactly.
    Rounding, not equality: under capture cuBLAS may pick other algorithms (measured on the H200: one
    element in 780 off by 0.127 on logits of order 3, with fla's or torch's KDA step alike); the bug
    this hunts moved them by 4.05."""
    for patch in BF16_GRAPH_VARIANTS[variant]:
        patch(monkeypatch)
    dtype = torch.bfloat16
    model = _model(1, dtype, separated=True)
    prompts = _prompts([5, 31, 12], seed=3)
    eager, tok = _prefilled(model, prompts, 4, 64)
    graphed, _ = _prefilled(model, prompts, 4, 64)
    graphs = DecodeGraphs(model, graphed)
    worst = 0.0
    for step in range(12):
        b = 4 if step < 8 else 2
        n = min(3, b)
        for st in (eager, graphed):
            st.tokens[:n] = tok[:n]
        want, want_r = model.decode_step(eager, b)
        got, got_r = graphs.replay(b)
        worst = max(worst, float((got[:n].float() - want[:n].float()).abs().max()))
        assert torch.equal(got_r[:n], want_r[:n]), f"{variant} step {step}: routing differs"
        torch.testing.assert_close(got[:n].float(), want[:n].float(), rtol=5e-2, atol=0.25,
                                   msg=lambda m, step=step: f"{variant} step {step}: {m}")
        tok = want[:n].argmax(-1)
    print(f"{variant}: max |graph - eager| over 12 steps {worst:.3e}")
    assert set(graphs.graphs) == {4, 2}


def _routing_divergence(a, b) -> str:
    """Where two completions of one request first route a token to other experts: tells a routing
    near-tie flip (numerics; the logits then legitimately part) from a decode-state bug (logits part
    while every expert choice so far agrees)."""
    n = min(a.routing.shape[0], b.routing.shape[0])
    diff = (a.routing[:n] != b.routing[:n]).flatten(1).any(1).nonzero()
    prompt = len(a.prompt_ids)  # rows: every prompt token, then each fed-back output token
    if not len(diff):
        return f"routing agrees at all {n} positions: a decode-state bug, not a routing flip"
    i = int(diff[0])
    where = f"prompt position {i}" if i < prompt else f"decode step {i - prompt}"
    return f"routing first differs at {where} (layers {(a.routing[i] != b.routing[i]).any(-1).nonzero().flatten().tolist()})"


def _token_divergence(a, b, names: str) -> str:
    """Where two greedy completions first pick other tokens, and whether that step was a near-tie:
    the top-2 logit margin of each there (a margin below the logits tolerance is numerics), the
    largest logit gap before it, and where routing first parted."""
    n = min(len(a.output_ids), len(b.output_ids))
    i = next((k for k in range(n) if a.output_ids[k] != b.output_ids[k]), n)
    if i == n:
        return f"{names}: same first {n} tokens, lengths {len(a.output_ids)} vs {len(b.output_ids)}"
    la, lb = a.meta["logits"][i].float(), b.meta["logits"][i].float()
    margins = [float(top[0] - top[1]) for top in (la.topk(2).values, lb.topk(2).values)]
    before = float((a.meta["logits"][:i + 1] - b.meta["logits"][:i + 1]).abs().max())
    return (f"{names}: first token difference at step {i} ({a.output_ids[i]} vs {b.output_ids[i]}); "
            f"top-2 margins there {margins[0]:.2e} / {margins[1]:.2e}; max |logit gap| up to it {before:.2e}; "
            f"{_routing_divergence(a, b)}")


@pytest.mark.parametrize("dtype", EQUALITY_DTYPES)
def test_engine_graph_mode_matches_eager_modes_with_joins_leaves_and_a_weight_update(dtype):
    """The engine in graph mode against static and dynamic eager modes: greedy, max_batch 4, seven
    requests of different lengths and budgets (joins, leaves, buckets 1..4, latent length growth),
    then load_weights and the same requests again. Same tokens; first decode logits within tolerance.
    fp32: random-init weights with separated routing, every token equal. bf16: two warmed-up
    checkpoints (``tests/k3core/rollout/warmed.py``: clear greedy margins; random-init weights part at
    near-ties, docs/results/gpu_tests.md) on held-out `reverse` prompts."""
    budgets = [9, 24, 30, 8, 3, 12, 6]
    if dtype == torch.float32:
        base = _model(4, dtype, separated=True)
        v1 = _model(5, dtype, separated=True).state_dict()
        prompts = _prompts([6, 3, 40, 1, 12, 25, 2], seed=6)
    else:
        base, v1 = warmed(0, dtype, "cuda"), warmed(1, dtype, "cuda").state_dict()
        prompts = reverse_prompts(len(budgets), seed=6)
    results = {}
    for mode in ("graph", "static", "dynamic"):
        eng = RolloutEngine(copy.deepcopy(base), max_batch=4, record_logits=True, decode=mode)
        assert eng.decode_mode == mode
        results[mode] = _greedy_then_reload(eng, prompts, budgets, v1)
        if mode == "graph":
            assert eng._decode.graphs is not None and set(eng._decode.graphs.graphs) <= {1, 2, 4}
    agree = total = 0
    for version in (0, 1):
        for g, s, d in zip(*(results[m][version] for m in ("graph", "static", "dynamic"))):
            assert g.weight_version == version
            torch.testing.assert_close(g.meta["logits"][:2], s.meta["logits"][:2], **TOL[dtype],
                                       msg=lambda m, g=g, s=s: f"{m}\n{_routing_divergence(g, s)}")
            if dtype == torch.float32:  # pairwise, so a failure says which mode parted and where
                assert g.output_ids == s.output_ids, _token_divergence(g, s, "graph vs static")
                assert s.output_ids == d.output_ids, _token_divergence(s, d, "static vs dynamic")
                torch.testing.assert_close(g.meta["logits"], d.meta["logits"], **TOL[dtype])
            else:  # bf16: a greedy token may part only at a near-tie (top-2 margin within tolerance)
                for a, b, names in ((g, s, "graph vs static"), (s, d, "static vs dynamic")):
                    n = min(len(a.output_ids), len(b.output_ids))
                    i = next((k for k in range(n) if a.output_ids[k] != b.output_ids[k]), n)
                    agree, total = agree + i, total + n
                    if i < n:
                        margin = float(b.meta["logits"][i].float().topk(2).values.diff().abs())
                        assert margin < TOL[dtype]["atol"] * 4, _token_divergence(a, b, names)
    if dtype == torch.bfloat16:  # greedy positions before any parting, over every pair of modes
        assert agree >= 0.99 * total, f"bf16 modes agree on {agree} of {total} greedy positions"
    assert results["graph"][0][0].output_ids != results["graph"][1][0].output_ids or \
        not torch.equal(results["graph"][0][0].meta["logits"], results["graph"][1][0].meta["logits"])


@pytest.mark.parametrize("experts", ["bf16", "w4a8"])
def test_every_decode_mode_agrees_with_the_no_cache_forward_bf16(experts):
    """dynamic, static and graph decode in bf16 (16 prompts through max_batch 4: joins and leaves)
    against the same model's no-cache forward on the GPU, on a warmed-up checkpoint: at least 99% of
    greedy positions agree (98% with W4A8 experts) (the decoded token is an argmax of the forward's
    logits) and every parting is a near-tie. FP8 activations turn a last-bit difference of the
    accumulation order into a whole code step, so W4A8 parts at more near-ties: 3-4 of 384 on an
    H100, each at a margin of 0.031, one bf16 step of the logit (docs/results/rollout_decode.md).
    Known flaky on the GPU: the no-cache forward itself differs by up to 0.08 in a logit from one
    call to the next (atomic adds), and 3 of 8 H100 runs parted once at a margin of 0.97. On the
    CPU the same check passes dynamic and static and fails a KDA state decayed by 1% per step
    (tests/k3core/rollout/test_decode_agreement.py)."""
    from k3core.rollout.quantized import quantize_engine_model

    model = warmed(0, torch.bfloat16, "cuda")
    if experts == "w4a8":
        quantize_engine_model(model, act_granularity="token")
        model.refresh_inference_caches()
    prompts = reverse_prompts()
    for mode in ("dynamic", "static", "graph"):
        got = greedy_agreement(model, prompts, greedy_outputs(copy.deepcopy(model), prompts, mode))
        print(f"{experts} {mode}: {got.describe()}")
        assert got.fraction >= (0.98 if experts == "w4a8" else 0.99), f"{experts} {mode}: {got.describe()}"
        assert all(p.margin < 4 * TOL[torch.bfloat16]["atol"] for p in got.partings), f"{experts} {mode}: {got.describe()}"


@pytest.mark.parametrize("experts", ["bf16", "mxfp4", "w4a8"])
def test_every_decode_mode_tracks_the_no_cache_forward_fp32(experts):
    """Every decode mode the engine has for these experts (dynamic, static, and graph where the
    experts can be captured: float and W4A8) against the no-cache forward of the same model on the same tokens:
    greedy, fp32, a router with clear margins, seven requests of different lengths and budgets
    through max_batch 4 (joins and leaves), every sampled-from logits row.

    The yardstick is exact: the same model's no-cache forward on the CPU (torch's chunked KDA, fp32
    matmuls, no TF32). On the GPU fla's fp32 dot products run in TF32 (10-bit mantissa) and cuDNN's
    fp32 convolutions may too, so even the GPU's own no-cache forward is off that reference: measured
    on the H200 at up to 0.019 on logits of mean magnitude 0.68 (a fixed 2e-3 bound failed every
    mode there, the decode modes' max |diff| being 0.015-0.019). A decode mode passes when it is as
    close to the CPU reference as the GPU's no-cache forward is, within a factor of 4 (decode runs
    the recurrent kernel token by token, the forward the chunked one: different roundings, same
    precision) plus 2e-3. A wrong decode state moves logits by O(1) (the bf16 graph failure in
    docs/results/gpu_tests.md: 4.05), far past that.

    "w4a8" rounds every activation row to FP8 (3 mantissa bits): a difference of one TF32 ulp in the
    decode path's input moves an element across an FP8 rounding boundary, a step of up to 1/16 of
    it, so rows agree in the mean, not pointwise (on CPU, where no TF32 is involved, the small
    preset's full forward of a prompt alone against the same prompt with tokens after it differs by
    0.09 at the prompt's last logits, the decode modes by at most 0.18, mean 0.011 on logits of mean
    magnitude 0.69). Its bound is relative to the GPU forward's own mean distance from the CPU's."""
    from k3core.rollout.quantized import quantize_engine_model

    base = _model(7, torch.float32, separated=True)
    if experts != "bf16":
        quantize_engine_model(base, act_granularity=None if experts == "mxfp4" else "token")
        base.refresh_inference_caches()
    on_cpu = copy.deepcopy(base).cpu()
    on_cpu.refresh_inference_caches()
    # graph: float experts, and W4A8 ones (their Triton kernel tiles on the device); weight-only
    # MXFP4 runs the torch path, which reads the expert counts on the host
    modes = ("dynamic", "static") + (("graph",) if experts in ("bf16", "w4a8") else ())
    lens, budgets = [6, 3, 40, 1, 12, 25, 2], [9, 24, 30, 8, 3, 12, 6]
    prompts = _prompts(lens, seed=8)
    for mode in modes:
        eng = RolloutEngine(copy.deepcopy(base), max_batch=4, record_logits=True, decode=mode)
        futures = [eng.submit(p, SamplingParams(max_new_tokens=k, temperature=0)) for p, k in zip(prompts, budgets)]
        while eng.step():
            pass
        got_d, fwd_d, mags = [], [], []
        for p, f in zip(prompts, futures):
            c = f.result()[0]
            ids = torch.tensor([p + c.output_ids[:-1]])
            with torch.no_grad():
                exact = on_cpu(ids).logits[0, len(p) - 1:].double()
                gpu_fwd = base(ids.cuda()).logits[0, len(p) - 1:].double().cpu()
            got = c.meta["logits"].double().cpu()
            got_d.append((got - exact).abs().flatten())
            fwd_d.append((gpu_fwd - exact).abs().flatten())
            mags.append(exact.abs().flatten())
        got_d, fwd_d, mag = torch.cat(got_d), torch.cat(fwd_d), torch.cat(mags).mean()
        report = (f"{experts} {mode}: |decode - CPU forward| max {float(got_d.max()):.3g} mean {float(got_d.mean()):.3g}; "
                  f"|GPU forward - CPU forward| max {float(fwd_d.max()):.3g} mean {float(fwd_d.mean()):.3g}; "
                  f"mean |logit| {float(mag):.3g}")
        print(report)
        if experts == "w4a8":
            # the max, like the mean, against the GPU forward's own: measured on the H200, the W4A8 forward
            # is itself up to 0.673 off the CPU reference (FP8 activation steps), its decode modes 0.561
            assert got_d.mean() <= 4 * fwd_d.mean() + 0.02 * mag and got_d.max() <= 2 * fwd_d.max() + 0.1, report
        else:
            assert got_d.max() <= 4 * fwd_d.max() + 2e-3, report
