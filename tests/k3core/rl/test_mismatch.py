"""Train/inference mismatch: divergences against closed forms, the engine path reproducing the engine's own
sampling log-probabilities, and a float engine matching the trainer where the W4A8 one does not."""

import copy
import math

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.mismatch import divergences, engine_logprobs, measure_mismatch, rollout_mismatch, trainer_logprobs
from k3core.rl.weights import engine_from_model
from k3core.rollout.engine import SamplingParams

TINY = K3Config.preset("tiny")
PAD = TINY.pad_token_id
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GPU_MODES = [pytest.param("cuda", m, marks=_CUDA) for m in ("static", "graph")]


def _model(seed=0):
    torch.manual_seed(seed)
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    with torch.no_grad():  # peakier distributions than the near-uniform init, so KLs are not all ~0
        m.lm_head.weight.mul_(20)
    return m


def test_divergences_closed_form():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.5, 0.25], [0.2, 0.2, 0.6]], dtype=torch.float64)
    d = divergences([p.log()[:1], p.log()[1:]], [q.log()[:1], q.log()[1:]], [[0], [2]])
    kl = [sum(pi * math.log(pi / qi) for pi, qi in zip(pr, qr)) for pr, qr in zip(p.tolist(), q.tolist())]
    assert math.isclose(d["kl"], sum(kl) / 2, rel_tol=1e-12) and math.isclose(d["kl_max"], max(kl), rel_tol=1e-12)
    assert math.isclose(d["kl_median"], min(kl), rel_tol=1e-12)  # torch's median of two: the lower
    r = [0.5 / 0.25, 0.3 / 0.6]
    assert math.isclose(d["k3"], sum(x - 1 - math.log(x) for x in r) / 2, rel_tol=1e-12)
    assert math.isclose(d["k3_pq"], sum(x * math.log(x) - (x - 1) for x in r) / 2, rel_tol=1e-12)
    assert math.isclose(d["logprob_abs_diff"], sum(abs(math.log(x)) for x in r) / 2, rel_tol=1e-12)
    assert d["tokens"] == 2
    same = divergences([p.log()], [p.log()], [[0, 1]])
    assert same["kl"] == same["k3"] == same["logprob_abs_diff"] == 0.0
    # an agentic trajectory's mask: only the sampled token (row 0) counts, a tool-result token does not
    masked = divergences([p.log()], [q.log()], [[0, 2]], masks=[[1, 0]])
    assert masked["tokens"] == 1 and math.isclose(masked["kl"], kl[0], rel_tol=1e-12)
    assert divergences([p.log()], [q.log()], [[0, 2]], masks=[None])["tokens"] == 2  # single-turn rows


@pytest.mark.parametrize("device,decode", [("cpu", "dynamic"), ("cpu", "static"), *GPU_MODES])
def test_engine_path_reproduces_the_engines_sampling_logprobs(device, decode):
    """Teacher-forcing the engine's own samples through its decode path gives back the log-probs it
    reported while sampling (temperature 0.7), for both the float and the W4A8 engine, in each decode
    mode (the engine sampling in that mode, ``engine_logprobs`` replaying it in that mode: the
    static state's padded bucket of 4 for 3 sequences included)."""
    for quantized in (False, True):
        eng = engine_from_model(_model(1).to(device), 0, quantized=quantized, decode=decode)
        comps = eng.generate([[1, 2, 3, 4], [5, 6], [7]], SamplingParams(max_new_tokens=5, temperature=0.7, seed=3),
                             pad_id=PAD)
        seqs = [(c.prompt_ids, c.output_ids) for c in comps]
        lps, routes = engine_logprobs(eng.model, seqs, PAD, temperature=0.7, decode=decode)
        for c, lp, rt in zip(comps, lps, routes):
            got = lp.gather(1, torch.tensor(c.output_ids, device=lp.device)[:, None]).squeeze(1).cpu()
            torch.testing.assert_close(got, torch.tensor(c.logprobs, dtype=torch.float64), rtol=0, atol=1e-4)
            assert torch.equal(rt.to(torch.int16), c.routing)


def test_float_engine_matches_trainer_and_w4a8_does_not():
    trainer = _model(2)
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 256, (n,), generator=g).tolist(), torch.randint(0, 256, (m,), generator=g).tolist())
            for n, m in [(3, 4), (6, 1), (2, 5)]]
    float_eng = engine_from_model(copy.deepcopy(trainer), 0, quantized=False)
    d = rollout_mismatch(trainer, float_eng.model, seqs, PAD)
    assert d["kl"] < 1e-9 and d["tokens"] == 10  # fp32: the runtime paths agree to rounding
    r = measure_mismatch(trainer, seqs, PAD, dtype=None, routing_replay=True)
    assert r["bf16_kl"] < 1e-9 < r["w4a8_kl"] and r["kl_ratio"] > 100
    # trainer log-probs with replayed routing equal its own when the routing is its own choice
    lp_e, routes = engine_logprobs(float_eng.model, seqs, PAD)
    a = trainer_logprobs(trainer, seqs, PAD, routing=routes)
    b = trainer_logprobs(trainer, seqs, PAD)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)
    bf16 = measure_mismatch(trainer, seqs, PAD)  # the default: a bf16 trainer and engines
    assert 0 < bf16["bf16_kl"] < bf16["w4a8_kl"]


def test_static_decode_path_gives_the_dynamic_paths_mismatch():
    """The mismatch measured through the static decode path (what the run's engine decodes with on
    CUDA) against the dynamic one, fp32 on the CPU: the same divergences up to rounding, with the
    float engine still at rounding level and the W4A8 one far above it."""
    trainer = _model(2)
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(0, 256, (n,), generator=g).tolist(), torch.randint(0, 256, (m,), generator=g).tolist())
            for n, m in [(3, 4), (6, 1), (2, 5)]]
    dyn = measure_mismatch(trainer, seqs, PAD, dtype=None, routing_replay=True, decode="dynamic")
    sta = measure_mismatch(trainer, seqs, PAD, dtype=None, routing_replay=True, decode="static")
    assert sta["bf16_kl"] < 1e-9 < sta["w4a8_kl"]
    assert math.isclose(sta["w4a8_kl"], dyn["w4a8_kl"], rel_tol=1e-3)
    assert math.isclose(sta["w4a8_k3"], dyn["w4a8_k3"], rel_tol=1e-3)
