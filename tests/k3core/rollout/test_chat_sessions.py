"""An agent loop written outside k3rl, talking plain OpenAI chat through the ``openai`` client to a
real rollout server subprocess on 127.0.0.1, records one trajectory per ``session_id``: every call
was sampled from exactly the trajectory's ids so far (the in-process engine, given those ids and the
call's seed, samples the same tokens), the sampled ids are the trained ones (loss mask 1, their
log-probabilities), what the harness added is untrained, and the server continued the session's
kept decode state instead of prefilling the history again. An edited conversation is refused naming
the session; a deleted session is gone."""

import json
import urllib.error
import urllib.request

import openai
import pytest

from flows.cli_serve import launch
from k3core.checkpoint.hf import init_checkpoint
from k3core.rollout.checkpoints import engine_from_checkpoint
from k3core.rollout.engine import SamplingParams
from k3core.tokenizer import load_tokenizer

from tests.k3core.rollout.test_chat_completions import _one_request

TOOLS = [{"type": "function", "function": {"name": "run_tests", "description": "run the tests",
                                            "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sessions")
    init_checkpoint("tiny", root / "bpe", seed=0, tokenizer="bpe")
    proc, client = launch(root / "bpe", "--max-batch", "8", log_path=root / "server.log",
                          env={"OMP_NUM_THREADS": "1"}, timeout=60, retries=2, backoff=0.05)
    tok = load_tokenizer(root / "bpe")
    yield {"url": client.url, "tok": tok, "engine": engine_from_checkpoint(root / "bpe"),
           "openai": openai.OpenAI(base_url=f"{client.url}/v1", api_key="unused", max_retries=0)}
    proc.terminate()
    proc.wait(20)


def _get(url, path, method="GET"):
    req = urllib.request.Request(f"{url}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stops(tok):
    """Turns end within a few tokens on a random model: a third of the vocabulary ends them."""
    return list(range(3, tok.vocab_size, 3))[:1024]


def _call(served, messages, session, seed):
    return served["openai"].chat.completions.create(
        model="k3", messages=messages, tools=TOOLS, max_tokens=12, seed=seed, logprobs=True,
        extra_body={"session_id": session, "return_token_ids": True, "stop_token_ids": _stops(served["tok"])})


def test_an_openai_agent_loop_records_one_trainable_trajectory(served):
    messages = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Fix add()."}]
    answers = []
    for turn in range(3):
        r = _call(served, messages, "episode-1", seed=10 + turn).model_dump()
        answers.append(r)
        assert r["session_id"] == "episode-1"
        assistant = {k: v for k, v in r["choices"][0]["message"].items() if v is not None}
        messages = messages + [assistant, {"role": "user", "content": f"the tests failed ({turn})"}]
    status, traj = _get(served["url"], "/v1/sessions/episode-1")
    assert status == 200 and traj["ended"] is None and len(traj["calls"]) == 3
    ids, mask = traj["prompt_ids"] + traj["output_ids"], traj["loss_mask"]
    assert traj["prompt_ids"] == answers[0]["prompt_token_ids"]
    assert len(mask) == len(traj["output_ids"]) == len(traj["logprobs"]) == len(traj["weight_versions"])
    P = len(traj["prompt_ids"])
    trained = 0
    engine = served["engine"]
    for turn, (r, call) in enumerate(zip(answers, traj["calls"])):
        a, b = call["span"]
        sampled = r["choices"][0]["token_ids"]
        # token-in/token-out: the call's prompt is the trajectory so far, its answer the next ids
        assert r["prompt_token_ids"] == ids[:P + a] and traj["output_ids"][a:b] == sampled
        assert mask[a:b] == [1] * len(sampled) and traj["weight_versions"][a:b] == [0] * len(sampled)
        lps = [t["logprob"] for t in r["choices"][0]["logprobs"]["content"]]
        assert traj["logprobs"][a:b] == pytest.approx(lps, abs=1e-6)
        trained += b - a
        # the in-process engine, from those ids with the call's seed, samples the same tokens
        params = SamplingParams(max_new_tokens=12, seed=10 + turn,
                                stop_token_ids=tuple(dict.fromkeys([*served["tok"].stop_ids, *_stops(served["tok"])])))
        assert _one_request(engine, r["prompt_token_ids"], params)[0].output_ids == sampled
    assert sum(mask) == trained and trained < len(mask)  # the harness's turns are in the trajectory, untrained
    # the added ids are the rendering of what the harness appended, and the model never re-read its history
    assert [call["added_ids"] > 0 for call in traj["calls"]] == [False, True, True]
    status, info = _get(served["url"], "/get_model_info")
    assert info["sessions"]["session_hits"] >= 2 and info["sessions"]["reused_tokens"] > 0


def test_an_edited_conversation_is_refused_and_a_deleted_session_is_gone(served):
    messages = [{"role": "user", "content": "Fix sub()."}]
    r = _call(served, messages, "episode-2", seed=1).model_dump()
    assistant = {k: v for k, v in r["choices"][0]["message"].items() if v is not None}
    edited = [{"role": "user", "content": "Fix mul()."}, assistant, {"role": "user", "content": "again"}]
    with pytest.raises(openai.BadRequestError, match="episode-2.*do not extend"):
        _call(served, edited, "episode-2", seed=2)
    # the refused call left the session as it was: the right continuation still works
    _call(served, messages + [assistant, {"role": "user", "content": "again"}], "episode-2", seed=2)
    assert len(_get(served["url"], "/v1/sessions/episode-2")[1]["calls"]) == 2
    status, out = _get(served["url"], "/v1/sessions/episode-2", method="DELETE")
    assert status == 200 and out["deleted"]
    assert _get(served["url"], "/v1/sessions/episode-2")[0] == 404
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        served["openai"].chat.completions.create(model="k3", messages=messages, n=2,
                                                 extra_body={"session_id": "episode-3"})
