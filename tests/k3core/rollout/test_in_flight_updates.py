"""A weight update that reaches sequences in flight (``RolloutEngine.load_weights(in_flight=...)``).

``continue``: each running sequence's logits rows equal an uncached reference that runs the old
weights over the prompt and the ids sampled before the update and the new weights over the rest,
on one cache (the decode state the old weights computed, continued by the new ones); each output
token records the version of its logits. ``abort``: the running sequences are sampled again whole by
the new weights, equal to a fresh engine at that version with the same seeds, and sequences that
finished before equal the old version's. A driver-less ``generate`` looping in one thread lets an
update from another thread in between two steps."""

import copy
import threading

import pytest
import torch

from k3core.model import K3Cache
from k3core.rollout.engine import RolloutEngine, SamplingParams

from tests.k3core.rollout.test_engine_batching import _model, _prompts

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: intra-op threads only add waits

LENS, BUDGETS = [3, 9, 1, 6, 12], [9, 4, 10, 8, 7]


def _requests():
    return [(p, SamplingParams(max_new_tokens=k, seed=i, n=1 + (i == 3)), None)
            for i, (p, k) in enumerate(zip(_prompts(LENS), BUDGETS))]


def _run(eng, swap_after: int | None, new_state=None, in_flight="continue"):
    """Every request of ``_requests``; after ``swap_after`` steps, ``new_state`` as version 1."""
    futures = eng.submit_many(_requests())
    steps = 0
    while True:
        if steps == swap_after:
            eng.load_weights(new_state, 1, in_flight=in_flight)
        if not eng.step():
            break
        steps += 1
    return [c for f in futures for c in f.result()]


def _split_reference(old, new, c):
    """Logits rows of ``c``'s tokens: the old weights over the prompt and the ids before the first
    token sampled from new logits (less one: the id whose forward made those logits ran on the new
    weights), the new weights over the rest, through one ``K3Cache``; a sequence admitted after the
    update is the new weights' alone."""
    n_old = c.token_versions.count(0)  # tokens sampled from the old weights' logits
    ids = c.prompt_ids + c.output_ids[:-1]
    cut = 0 if n_old == 0 else len(c.prompt_ids) + n_old - 1 if n_old < len(c.output_ids) else len(ids)
    cache = K3Cache.empty(old.config)
    rows = []
    with torch.no_grad():
        for model, part in ((old, ids[:cut]), (new, ids[cut:])):
            if part:
                out = model(torch.tensor([part]), torch.ones(1, len(part), dtype=torch.bool), cache=cache)
                rows.append(out.logits[0])
    return torch.cat(rows)[len(c.prompt_ids) - 1:]


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_continue_runs_the_new_weights_on_the_old_decode_state(decode):
    """max_batch 3, five requests (one with n=2): the update lands after 3 steps, with three sequences
    mid-decode and three queued. Every completion's logits rows equal the split reference, its token
    versions are its old tokens then its new ones, and the update reached at least one sequence in the
    middle of its output."""
    old, new = _model(0), _model(1)
    ref_old, ref_new = copy.deepcopy(old), copy.deepcopy(new)
    eng = RolloutEngine(old, max_batch=3, record_logits=True, decode=decode)
    comps = _run(eng, 3, new.state_dict())
    assert eng.weight_version == 1 and eng.stats["updates_in_flight"] == 1 and eng.stats["aborted"] == 0
    mixed = 0
    for c in comps:
        v = c.token_versions
        assert len(v) == len(c.output_ids) and v == sorted(v) and set(v) <= {0, 1}
        assert c.weight_version == v[0]
        mixed += 0 < v.count(0) < len(v)
        want = _split_reference(ref_old, ref_new, c)
        torch.testing.assert_close(c.meta["logits"], want, rtol=0, atol=1e-10)
        lp = torch.log_softmax(want, -1).gather(1, torch.tensor(c.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), lp, rtol=0, atol=1e-10)
    assert mixed >= 2, [c.token_versions for c in comps]
    assert any(set(c.token_versions) == {1} for c in comps)  # queued at the update: the new version only


def test_abort_samples_the_running_sequences_again_on_the_new_weights():
    """The update after 5 steps with ``abort``: each completion is one version's, equal (ids,
    log-probs) to a fresh engine's at that version with the same seeds; the three running at the
    update were aborted, the one that had finished is the old version's."""
    old, new = _model(0), _model(1)
    refs = {v: _run(RolloutEngine(copy.deepcopy(m), max_batch=3), None) for v, m in ((0, old), (1, new))}
    eng = RolloutEngine(old, max_batch=3)
    comps = _run(eng, 5, new.state_dict(), in_flight="abort")  # the 4-token request finished at step 4
    assert eng.stats["aborted"] == 3 and eng.weight_version == 1
    versions = []
    for k, c in enumerate(comps):
        (v,) = set(c.token_versions)
        versions.append(v)
        want = refs[v][k]
        assert (c.prompt_index, c.sample_index, c.output_ids) == (want.prompt_index, want.sample_index, want.output_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-10)
        assert c.weight_version == v
    assert versions.count(0) >= 1 and versions.count(1) >= 4, versions  # finished before / aborted or queued


def test_drain_is_the_default_and_in_flight_names_its_choices():
    old, new = _model(0), _model(1)
    eng = RolloutEngine(old, max_batch=3)
    comps = _run(eng, 3, new.state_dict(), in_flight="drain")
    assert all(len(set(c.token_versions)) == 1 for c in comps) and eng.stats["updates_in_flight"] == 0
    with pytest.raises(ValueError, match="in_flight must be one of"):
        eng.load_weights(new.state_dict(), 2, in_flight="finish")


def test_an_update_from_another_thread_lands_between_the_steps_of_a_looping_generate():
    """A driver-less ``generate`` steps in a loop in this thread (it takes the model lock back at once
    after each step); a ``continue`` update from another thread, started after the second step, gets in
    while the long generation goes on: later tokens carry version 1."""
    old, new = _model(0), _model(1)
    eng = RolloutEngine(old, max_batch=8)
    state = new.state_dict()
    done = threading.Event()

    def update():
        while eng.steps < 2:
            done.wait(0.001)
        eng.load_weights(state, 1, in_flight="continue")
        done.set()

    t = threading.Thread(target=update)
    t.start()
    comps = eng.generate(_prompts([4, 7]), SamplingParams(max_new_tokens=200, seed=3, n=2))
    t.join(30)
    assert done.is_set()
    for c in comps:
        assert c.token_versions[:2] == [0, 0] and c.token_versions[-1] == 1 and c.token_versions == sorted(c.token_versions)
