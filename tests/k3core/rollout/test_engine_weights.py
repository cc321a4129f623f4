"""Weight swaps: a mismatched state is refused with the old version still serving; an accepted one is
applied between requests (sequences in flight finish on the version they started with, queued ones
run on the new one), also with the background driver and concurrent submitters."""

import threading

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rollout.engine import EngineStopped, RolloutEngine, SamplingParams

TINY = K3Config.preset("tiny")
GREEDY = SamplingParams(max_new_tokens=5, temperature=0)
PROMPTS = [[256, 10 + i, 20 + 2 * i, 30 + 3 * i] for i in range(6)]


def _model(seed):
    torch.manual_seed(seed)
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.cast(torch.float64)  # fp64: greedy argmax never flips with batch composition


@pytest.fixture(scope="module")
def versions():
    """Three weight versions and each one's greedy outputs for PROMPTS (a fresh engine each)."""
    states, outputs = [], []
    for v in range(3):
        m = _model(v)
        states.append({k: t.detach().clone() for k, t in m.state_dict().items()})
        outputs.append([c.output_ids for c in RolloutEngine(m).generate(PROMPTS, GREEDY)])
    assert outputs[0] != outputs[1] != outputs[2]
    return states, outputs


def test_mismatched_state_is_refused_and_the_old_version_keeps_serving(versions):
    states, outputs = versions
    eng = RolloutEngine(_model(0))
    bad_shape = dict(states[1], **{"lm_head.weight": torch.zeros(3, 3, dtype=torch.float64)})
    bad_dtype = {k: v.float() if k == "lm_head.weight" else v for k, v in states[1].items()}
    missing = {k: v for k, v in states[1].items() if k != "lm_head.weight"}
    extra = dict(states[1], **{"model.bogus": torch.zeros(1)})
    for bad, msg in ((bad_shape, "shape"), (bad_dtype, "dtype"), (missing, "missing"), (extra, "unexpected")):
        with pytest.raises(ValueError, match=f"refused.*{msg}"):
            eng.load_weights(bad, 1)
        assert eng.weight_version == 0
    assert [c.output_ids for c in eng.generate(PROMPTS, GREEDY)] == outputs[0]
    eng.load_weights(states[1], 1)
    out = eng.generate(PROMPTS, GREEDY)
    assert [c.output_ids for c in out] == outputs[1] and {c.weight_version for c in out} == {1}


def test_update_waits_for_sequences_in_flight_and_queued_requests_run_on_the_new_version(versions):
    states, outputs = versions
    eng = RolloutEngine(_model(0), max_batch=2)
    futures = [eng.submit(p, GREEDY) for p in PROMPTS[:4]]
    eng.step()  # requests 0 and 1 admitted and one token in; 2 and 3 wait
    assert eng.load() == {**eng.load(), "running": 2, "waiting": 2}
    eng.load_weights(states[1], 1)  # no driver: drains by stepping, admitting nothing meanwhile
    assert eng.weight_version == 1 and eng.load()["running"] == 0 and eng.load()["waiting"] == 2
    while eng.step():
        pass
    got = [f.result()[0] for f in futures]
    assert [c.weight_version for c in got] == [0, 0, 1, 1]
    assert [c.output_ids for c in got] == outputs[0][:2] + outputs[1][2:4]


def test_concurrent_submitters_during_updates_with_the_driver(versions):
    """The driver decodes while two threads submit and the main thread swaps versions 1 and 2:
    every completion is exactly the greedy output of the version it reports."""
    states, outputs = versions
    eng = RolloutEngine(_model(0), max_batch=4).start()
    results, errors = [], []

    def client(offset):
        try:
            for r in range(6):
                i = (offset + r) % len(PROMPTS)
                results.append((i, eng.submit(PROMPTS[i], GREEDY).result(timeout=60)[0]))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    eng.load_weights(states[1], 1)
    eng.load_weights(states[2], 2)
    for t in threads:
        t.join(60)
    eng.stop()
    assert not errors and len(results) == 12
    for i, c in results:
        assert c.output_ids == outputs[c.weight_version][i], (i, c.weight_version)
    assert eng.weight_version == 2
    with pytest.raises(EngineStopped):
        eng.submit(PROMPTS[0], GREEDY)


def test_stop_fails_waiting_requests_clearly():
    eng = RolloutEngine(_model(0), max_batch=1)
    futures = [eng.submit(p, GREEDY) for p in PROMPTS[:3]]
    eng.stop()  # never started: nothing runs, every waiting request fails
    for f in futures:
        with pytest.raises(EngineStopped, match="stopped"):
            f.result(timeout=5)
