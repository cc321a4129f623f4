"""Sampling: top-k / top-p masks against hand-computed cases, the batched per-row filter and the
inverse-CDF sampler against the plain references, seeds that reproduce and do not depend on which
requests share the batch, stop tokens and stop strings."""

import math

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rollout.engine import EngineOverloaded, RolloutEngine
from k3core.rollout.naive import filter_logits, sample_reference
from k3core.rollout.sampling import (SamplingParams, derive_seed, filter_logits_batched, sample_batch, sample_from_probs,
                                     sample_generator)

TINY = K3Config.preset("tiny")
NEG = float("-inf")
# probabilities 0.05, 0.5, 0.1, 0.2, 0.15 (shuffled so order is not the answer)
PROBS = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15], dtype=torch.float64)
LOGITS = PROBS.log().unsqueeze(0)


def _kept(filtered):
    return set(torch.isfinite(filtered[0]).nonzero()[:, 0].tolist())


@pytest.mark.parametrize("top_k,top_p,kept", [
    (0, 1.0, {0, 1, 2, 3, 4}),
    (2, 1.0, {1, 3}),  # the two largest: 0.5, 0.2
    (0, 0.6, {1, 3}),  # mass before each token: 0, .5, .7 -> the token crossing 0.6 (0.2) is kept
    (0, 0.45, {1}),  # 0.5 alone reaches 0.45: the mass before 0.2 (0.5) >= 0.45, dropped
    (0, 0.75, {1, 3, 4}),  # before: 0, .5, .7, .85 -> keep three
    # top-p after top-k works on the top-k renormalised mass: top 3 are .5/.85, .2/.85, .15/.85;
    # mass before the third = .7/.85 = 0.82 >= 0.8: dropped (unrenormalised it would be 0.7 < 0.8)
    (3, 0.8, {1, 3}),
    (5, 0.99, {0, 1, 2, 3, 4}),
    (1, 0.3, {1}),
])
def test_top_k_top_p_masks_hand_computed(top_k, top_p, kept):
    assert _kept(filter_logits(LOGITS, top_k, top_p)) == kept
    got = filter_logits_batched(LOGITS, torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float64))
    assert _kept(got) == kept
    assert torch.equal(got[torch.isfinite(got)], LOGITS[torch.isfinite(got)])  # kept logits unchanged


def test_batched_filter_and_sampler_match_references_per_row():
    g = torch.Generator().manual_seed(0)
    B, V = 64, 50
    logits = torch.randn(B, V, generator=g, dtype=torch.float64) * 2
    top_k = torch.randint(0, 8, (B,), generator=g)
    top_p = torch.where(torch.rand(B, generator=g) < 0.3, 1.0, torch.rand(B, generator=g, dtype=torch.float64))
    temp = 0.3 + torch.rand(B, generator=g, dtype=torch.float64)
    u = torch.rand(B, generator=g, dtype=torch.float64)
    filt = filter_logits_batched(logits / temp[:, None], top_k, top_p)
    tok = sample_from_probs(torch.softmax(filt, -1), u)
    for b in range(B):
        want = filter_logits((logits[b] / temp[b]).unsqueeze(0), int(top_k[b]), float(top_p[b]))[0]
        assert torch.equal(torch.isfinite(filt[b]), torch.isfinite(want))
        ref_tok, _ = sample_reference(logits[b], float(temp[b]), int(top_k[b]), float(top_p[b]), float(u[b]))
        assert int(tok[b]) == ref_tok


def test_sample_batch_matches_the_reference_per_row_with_greedy_rows_and_generator_draws():
    """What the engine runs (``sample_batch``: temperature, greedy rows, top-k / top-p, one uniform
    per sampling row from its own generator, log-probs before truncation) against
    ``sample_reference`` fed the uniform that row's generator gives. Greedy rows draw nothing."""
    g = torch.Generator().manual_seed(1)
    B, V = 48, 40
    logits = torch.randn(B, V, generator=g, dtype=torch.float64) * 3
    params = [SamplingParams(temperature=0.0 if b % 5 == 0 else 0.25 + float(torch.rand((), generator=g)),
                             top_k=int(torch.randint(0, 6, (), generator=g)),
                             top_p=1.0 if b % 3 == 0 else 0.2 + 0.8 * float(torch.rand((), generator=g)))
              for b in range(B)]
    gens = [sample_generator(99, b) for b in range(B)]
    tok, lp = sample_batch(logits, params, gens)
    for b, p in enumerate(params):
        fresh = sample_generator(99, b)
        u = 0.0 if p.temperature == 0 else float(torch.rand((), generator=fresh, dtype=torch.float64))
        want_tok, want_lp = sample_reference(logits[b], p.temperature, p.top_k, p.top_p, u)
        assert int(tok[b]) == want_tok, f"row {b}: {p}"
        assert abs(float(lp[b]) - want_lp) < 1e-12, f"row {b}: {p}"
        # each row's generator advanced by exactly the draws it made (none for a greedy row)
        assert torch.equal(gens[b].get_state(), fresh.get_state()), f"row {b}: {p}"
    all_greedy = [SamplingParams(temperature=0.0)] * B
    tok, lp = sample_batch(logits, all_greedy, [sample_generator(0, b) for b in range(B)])
    for b in range(B):
        assert (int(tok[b]), pytest.approx(float(lp[b]), abs=1e-12)) == sample_reference(logits[b], 0.0, 0, 1.0, 0.0)


def test_inverse_cdf_never_draws_a_masked_token_and_follows_the_distribution():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]])
    u = torch.linspace(0, 1, 4001, dtype=torch.float64)  # u = 1 included: rounding must not reach a masked token
    toks = sample_from_probs(probs.expand(len(u), -1), u)
    assert set(toks.tolist()) == {1, 3}
    assert abs((toks == 3).double().mean().item() - 0.75) < 1e-3


def _engine(**kw):
    torch.manual_seed(0)
    m = K3ForCausalLM(TINY)
    m.reset_parameters(0)
    return RolloutEngine(m, **kw)


PROMPT = [256, 72, 101, 108, 108, 111]
OTHERS = [[256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [256, 66], [256, 7, 7, 7]]


def _run(eng, requests):
    futures = [eng.submit(p, sp) for p, sp in requests]
    while eng.step():
        pass
    return [f.result() for f in futures]


def test_seeds_reproduce_and_do_not_depend_on_batch_composition():
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=40, top_p=0.95, n=3, seed=1234)
    alone = _run(_engine(), [(PROMPT, sp)])[0]
    again = _run(_engine(), [(PROMPT, sp)])[0]
    assert [c.output_ids for c in alone] == [c.output_ids for c in again]
    # the same request behind others (max_batch 2: it joins mid-decode, beside different rows)
    noise = [(p, SamplingParams(max_new_tokens=3 + i, temperature=0.7, seed=i)) for i, p in enumerate(OTHERS)]
    for max_batch in (2, 5, 64):
        crowded = _run(_engine(max_batch=max_batch), noise + [(PROMPT, sp)])[-1]
        assert [c.output_ids for c in crowded] == [c.output_ids for c in alone]
        for a, b in zip(alone, crowded):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    # sample j of seed s == a one-sample request with seed s + j; other seeds give other samples
    for j in range(3):
        single = _run(_engine(), [(PROMPT, SamplingParams(**{**sp.__dict__, "n": 1, "seed": 1234 + j}))])[0][0]
        assert single.output_ids == alone[j].output_ids
    assert len({tuple(c.output_ids) for c in alone}) == 3


def test_generate_keeps_its_api_and_per_prompt_seeds():
    eng = _engine()
    sp = SamplingParams(max_new_tokens=5, n=2, seed=7)
    out = eng.generate([PROMPT, OTHERS[0]], sp, pad_id=TINY.pad_token_id)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [c.output_ids for c in eng.generate([PROMPT, OTHERS[0]], sp)] == [c.output_ids for c in out]
    # prompt i's request seed is derive_seed(seed, i): reordering prompts does not change a prompt's samples
    direct = _run(_engine(), [(OTHERS[0], SamplingParams(max_new_tokens=5, n=2, seed=derive_seed(7, 1)))])[0]
    assert [c.output_ids for c in direct] == [c.output_ids for c in out[2:]]
    for c in out:
        assert len(c.logprobs) == len(c.output_ids) and all(lp <= 0 for lp in c.logprobs)
        positions = len(c.prompt_ids) + len(c.output_ids) - 1
        assert c.routing.shape == (positions, len(TINY.moe_layers), TINY.num_experts_per_token)


def test_greedy_logprobs_and_mixed_temperatures_in_one_batch():
    eng = _engine(record_logits=True)
    greedy, hot = _run(eng, [(PROMPT, SamplingParams(max_new_tokens=4, temperature=0)),
                            (PROMPT, SamplingParams(max_new_tokens=4, temperature=2.0, seed=3))])
    lg = greedy[0].meta["logits"]
    assert greedy[0].output_ids == lg.argmax(-1).tolist()
    want = torch.log_softmax(lg, -1).gather(1, torch.tensor(greedy[0].output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(greedy[0].logprobs), want)
    lh = hot[0].meta["logits"]
    want = torch.log_softmax(lh / 2.0, -1).gather(1, torch.tensor(hot[0].output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(hot[0].logprobs), want)


def test_stop_tokens_and_stop_checker():
    eng = _engine()
    free = _run(eng, [(PROMPT, SamplingParams(max_new_tokens=8, seed=5))])[0][0]
    stop_tok = free.output_ids[2]
    first = free.output_ids.index(stop_tok)
    by_token = _run(eng, [(PROMPT, SamplingParams(max_new_tokens=8, seed=5, stop_token_ids=(stop_tok,)))])[0][0]
    assert by_token.output_ids == free.output_ids[:first + 1]
    assert by_token.finish_reason == "stop" and by_token.meta["matched"] == stop_tok
    # a stop string: the server's checker decodes the output; here "matched" once 4 tokens exist
    checker = lambda ids: "XY" if len(ids) >= 4 else None  # noqa: E731
    futures = eng.submit(PROMPT, SamplingParams(max_new_tokens=8, seed=5), stop_checker=checker)
    while eng.step():
        pass
    c = futures.result()[0]
    assert c.output_ids == free.output_ids[:4] and c.finish_reason == "stop" and c.meta["matched"] == "XY"
    assert free.finish_reason == "length" and free.meta["matched"] == 8
    broken = eng.submit(PROMPT, SamplingParams(max_new_tokens=8), stop_checker=lambda ids: 1 / 0)
    while eng.step():
        pass
    assert broken.result()[0].finish_reason == "abort"


def test_bad_requests_and_overload_fail_at_submit():
    eng = _engine(max_queue=3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([1, TINY.vocab_size], SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        eng.submit([], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        eng.submit([1], SamplingParams(top_p=0.0))
    eng.submit([1, 2], SamplingParams(n=2, max_new_tokens=2))
    with pytest.raises(EngineOverloaded, match="queue limit 3"):
        eng.submit([1, 2], SamplingParams(n=2))
    assert eng.load()["waiting"] == 2  # the refused request queued nothing
    assert len(eng.generate([[1, 2]] * 4, SamplingParams(max_new_tokens=2))) == 4  # generate is not bounded
    assert math.isfinite(derive_seed(2**62, 10**9)) and derive_seed(1, 0) != derive_seed(1, 1)
