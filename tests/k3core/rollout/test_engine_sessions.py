"""Decode state kept between the turns of a session: a turn that extends its session's ids prefills
only the new ids on top of the kept KDA states, conv tails and MLA latents, and gives exactly what
the uncached forward of the whole history gives (logits, log-probabilities, routing), in the dynamic
and the static decode state; a weight update, an eviction or a prompt that does not extend the kept
ids falls back to a full prefill with the same result."""

import copy

import pytest
import torch

from k3core.rollout.engine import RolloutEngine, SamplingParams

from tests.k3core.rollout.test_engine_batching import TINY, _model, _prompts


def _stop_after(k):
    """A stop checker ending the turn after ``k`` tokens with finish reason "stop" (what a stop id does)."""
    return lambda ids: "turn-end" if len(ids) >= k else None


def _turn(eng, requests, sessions):
    """requests: [(prompt, tokens this turn)]; runs them to the end -> one Completion each."""
    futures = eng.submit_many([(p, SamplingParams(max_new_tokens=64, seed=7 + i), _stop_after(k))
                               for i, (p, k) in enumerate(requests)], sessions=sessions)
    while eng.step():
        pass
    return [f.result()[0] for f in futures]


def _check_against_full_forward(ref, c):
    ids = torch.tensor([c.prompt_ids + c.output_ids[:-1]])
    with torch.no_grad():
        out = ref(ids, return_routing=True)
    P = len(c.prompt_ids)
    torch.testing.assert_close(c.meta["logits"], out.logits[0, P - 1:], rtol=0, atol=1e-10)
    assert torch.equal(c.routing, out.routing[0].to(torch.int16))
    lp = torch.log_softmax(out.logits[0, P - 1:], -1).gather(1, torch.tensor(c.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), lp, rtol=0, atol=1e-10)


def _episodes(eng, n_turns=3):
    """Three sessions and one session-less request per turn; the sessions' tool results have 4, 4
    and 7 ids (so two continue together in one prefill and one alone), joined by a fresh request."""
    g = torch.Generator().manual_seed(3)
    prompts = _prompts([5, 11, 2], seed=4)
    out = []
    for turn in range(n_turns):
        fresh = _prompts([6 + turn], seed=10 + turn)[0]
        comps = _turn(eng, [(p, 3 + i) for i, p in enumerate(prompts)] + [(fresh, 4)], ["a", "b", "c", None])
        out.append(comps)
        prompts = [c.prompt_ids + c.output_ids + torch.randint(0, 256, (n,), generator=g).tolist()
                   for c, n in zip(comps, (4, 4, 7))]
    return out


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_kept_state_continues_a_session_exactly_as_the_full_forward(decode):
    model = _model(2)
    ref = copy.deepcopy(model)
    eng = RolloutEngine(model, max_batch=4, record_logits=True, decode=decode)
    turns = _episodes(eng)
    for comps in turns:
        for c in comps:
            assert c.finish_reason == "stop"
            _check_against_full_forward(ref, c)
    # turn 1 had nothing kept; turns 2 and 3 continued all three sessions, reusing their histories
    assert eng.stats["session_misses"] == 3 and eng.stats["session_hits"] == 6
    reused = sum(len(c.prompt_ids) + len(c.output_ids) - 1 for comps in turns[:2] for c in comps[:3])
    assert eng.stats["reused_tokens"] == reused
    # the sessions' continued prefills fed only the new ids (3 turns of fresh prompts + first prompts + suffixes)
    fed = sum(len(c.prompt_ids) for c in turns[0]) + sum(len(c.prompt_ids) for c in turns[1][3:] + turns[2][3:])
    assert eng.stats["prefill_tokens"] == fed + 2 * (1 + 4 + 1 + 4 + 1 + 7)
    kept = eng.kept_sessions()
    assert kept["sessions"] == 3 and kept["bytes"] > 0
    assert eng.release_sessions(["a", "b", "c", "unknown"]) == kept["bytes"]
    assert eng.kept_sessions() == {"sessions": 0, "bytes": 0}


def test_kept_state_and_re_prefill_sample_the_same_tokens():
    """The same episodes with no state kept (session_bytes=0, every turn a full prefill) sample
    the same ids with the same log-probabilities."""
    kept = _episodes(RolloutEngine(_model(2), max_batch=4, record_logits=True))
    eng = RolloutEngine(_model(2), max_batch=4, record_logits=True, session_bytes=0)
    again = _episodes(eng)
    assert eng.stats["session_hits"] == 0 and eng.kept_sessions()["sessions"] == 0
    for a, b in zip(kept, again):
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids and x.prompt_ids == y.prompt_ids
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-10)


def test_fallbacks_weight_update_eviction_and_a_prompt_that_does_not_extend():
    model = _model(2)
    ref = copy.deepcopy(model)
    eng = RolloutEngine(model, max_batch=4, record_logits=True)
    p = _prompts([5, 9], seed=4)
    first = _turn(eng, [(p[0], 3), (p[1], 3)], ["a", "b"])
    # "a" rewrites its history (not an extension), "b" extends it: a miss and a hit
    changed = [first[0].prompt_ids[0] ^ 1] + first[0].prompt_ids[1:] + first[0].output_ids + [1, 2]
    second = _turn(eng, [(changed, 2), (first[1].prompt_ids + first[1].output_ids + [3, 4], 2)], ["a", "b"])
    assert (eng.stats["session_misses"], eng.stats["session_hits"]) == (3, 1)
    # a weight update drops every kept state: the next turn prefills in full, under the new weights
    new = {k: v + 0.01 for k, v in model.state_dict().items() if v.is_floating_point()}
    eng.load_weights({**model.state_dict(), **new}, 1)
    ref.load_state_dict({**ref.state_dict(), **new})
    assert eng.kept_sessions()["sessions"] == 0
    third = _turn(eng, [(second[1].prompt_ids + second[1].output_ids + [5], 2)], ["b"])
    assert eng.stats["session_misses"] == 4 and third[0].weight_version == 1
    for c in first + second + third:
        _check_against_full_forward(ref if c is third[0] else _model(2), c)
    # a budget that holds one kept state: the older one is evicted, and its next turn prefills in full
    small = RolloutEngine(_model(2), max_batch=4, record_logits=True)
    p = _prompts([5, 5], seed=4)  # two states of the same size
    one = _turn(small, [(p[0], 3)], ["a"])
    small.session_bytes = small.kept_sessions()["bytes"] + 1
    _turn(small, [(p[1], 3)], ["b"])
    assert small.stats["session_evictions"] == 1 and small.kept_sessions()["sessions"] == 1
    again = _turn(small, [(one[0].prompt_ids + one[0].output_ids + [7], 2)], ["a"])
    assert small.stats["session_hits"] == 0
    _check_against_full_forward(_model(2), again[0])


def test_sessions_are_one_trajectory_each():
    eng = RolloutEngine(_model(2, torch.float32))
    with pytest.raises(ValueError, match="n=1"):
        eng.submit_many([([1, 2], SamplingParams(n=2), None)], sessions=["a"])
    with pytest.raises(ValueError, match="one per request"):
        eng.submit_many([([1, 2], SamplingParams(), None)], sessions=["a", "b"])
    assert TINY.vocab_size > 256
