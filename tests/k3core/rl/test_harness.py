"""Harness environments (``k3core.rl.harness``): an agent loop of the user's, talking plain OpenAI
chat through the ``openai`` client, against the embedded tiny engine served on 127.0.0.1 for the
rollout. Its episodes become rollout rows whose ids are exactly what the model saw and sampled:
the sampled spans' log-probabilities equal a full forward of the model over the whole trajectory,
the harness's additions are untrained, routing covers every position; the engine goes back to the
stages afterwards. The documented example loads and runs; bad harnesses fail naming the fix."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai", reason="harness tests need the test extra (openai)")

from k3core.checkpoint.hf import init_checkpoint  # noqa: E402
from k3core.rl.harness import HarnessError  # noqa: E402
from k3core.rl.prompting import PromptFormat  # noqa: E402
from k3core.rl.tables import rollout_table  # noqa: E402
from k3core.rollout.checkpoints import engine_from_checkpoint  # noqa: E402
from k3core.rollout.engine import SamplingParams  # noqa: E402
from k3core.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TOOLS = [{"type": "function", "function": {"name": "look", "description": "look around",
                                            "parameters": {"type": "object", "properties": {}}}}]


class ThreeCalls:
    """Three calls per episode, a user turn between them; turns end within a few ids on a random
    model (a third of the vocabulary stops them). ``break_with``: what goes wrong."""

    name = "three-calls"

    def __init__(self, tok, break_with=None):
        self.tok, self.break_with = tok, break_with

    def prompts(self, rng, n):
        return [f"task {rng.randint(0, 99)}" for _ in range(n)]

    def reward(self, prompt, completion):
        return 0.5

    def run_agent(self, endpoint, prompt):
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        extra = {**endpoint.extra_body, "stop_token_ids": list(range(3, self.tok.vocab_size, 3))[:1024]}
        if self.break_with == "no-session":
            extra.pop("session_id")
        for turn in range(3):
            if self.break_with == "raise" and turn == 1:
                raise RuntimeError("harness bug")
            reply = client.chat.completions.create(
                model=endpoint.model, messages=messages, tools=TOOLS, max_tokens=endpoint.max_tokens, extra_body=extra,
                temperature=0.5 if self.break_with == "temperature" else endpoint.temperature)
            messages += [{k: v for k, v in reply.choices[0].message.model_dump().items() if v is not None},
                         {"role": "user", "content": f"go on ({turn})"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    init_checkpoint("tiny", root / "bpe", seed=0, tokenizer="bpe")
    return root / "bpe", load_tokenizer(root / "bpe")


def _params(n=2):
    """40 ids per call: a turn with no stop id among them (so cut by the length) has odds (2/3)^40."""
    return SamplingParams(max_new_tokens=40, temperature=1.0, n=n, seed=0)


def test_harness_episodes_are_what_the_model_saw_and_sampled(tiny):
    path, tok = tiny
    engine = engine_from_checkpoint(path)
    env = ThreeCalls(tok)
    rows = rollout_table(engine, PromptFormat.of(tok, env), ["task 1", "task 2"], _params(), 0).to_pylist()
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    model = engine.model
    for r in rows:
        ids, mask = r["prompt_ids"] + r["output_ids"], r["loss_mask"]
        assert r["prompt_ids"] == tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tools=TOOLS,
                                                          add_generation_prompt=True)
        roles = [t["role"] for t in json.loads(r["turns"])]
        assert roles == ["assistant", "harness", "assistant", "harness", "assistant"]
        assert 0 < sum(mask) < len(mask) and mask[-1] == 1
        with torch.no_grad():  # an independent reference: the whole trajectory in one uncached forward
            logits = model(torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        P = len(r["prompt_ids"])
        sampled = [k for k, m in enumerate(mask) if m]
        torch.testing.assert_close(torch.tensor([r["logprobs"][k] for k in sampled], dtype=torch.float64),
                                   logp[[P - 1 + k for k in sampled]], rtol=0, atol=2e-4)
        assert all(r["logprobs"][k] == 0.0 for k, m in enumerate(mask) if not m)
        assert len(r["routing"]) == (len(ids) - 1) * len(model.moe_layer_ids) * model.config.num_experts_per_token
        assert r["token_versions"] == [0 if m else None for m in mask] and r["weight_version"] == 0
    # the engine serves the stages again, and kept no episode's state
    assert engine.generate([rows[0]["prompt_ids"]], SamplingParams(max_new_tokens=2, seed=1))[0].output_ids
    assert not engine.is_serving and engine.kept_sessions()["sessions"] == 0


@pytest.mark.parametrize("broken, says", [
    ("no-session", "made no call with its session: pass extra_body=endpoint.extra_body"),
    ("temperature", r"sampled at temperature 0.5, the run samples at 1.0 \(--temperature\)"),
    ("raise", "run_agent raised RuntimeError: harness bug"),
])
def test_a_harness_that_cannot_train_fails_naming_the_fix(tiny, broken, says):
    path, tok = tiny
    env = ThreeCalls(tok, break_with=broken)
    with pytest.raises(HarnessError, match=says):
        rollout_table(engine_from_checkpoint(path), PromptFormat.of(tok, env), ["task 1"], _params(1), 0)


def test_the_documented_harness_runs(tiny, tmp_path, monkeypatch):
    path, tok = tiny
    doc = (ROOT / "docs" / "environments.md").read_text()
    m = re.search(r"<!-- k3rl-test: calc_harness.py -->\s*```python\n(.*?)```", doc, re.S)
    assert m, "docs/environments.md lost its tested harness example"
    (tmp_path / "calc_harness.py").write_text(m.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "calc_harness", raising=False)
    from k3core.rl.envs import load_env

    env = load_env("calc_harness:make_env")
    assert env.run_agent and env.reward("Compute 12*3.", "36") == 1.0
    import calc_harness

    assert calc_harness.calculate('{"expression": "12*3+1"}') == "37"
    assert calc_harness.calculate('{"expression": "__import__(1)"}').startswith("error:")
    rows = rollout_table(engine_from_checkpoint(path), PromptFormat.of(tok, env), ["Compute 12*3."], _params(), 0)
    assert rows.num_rows == 2 and all(sum(r) > 0 for r in rows.column("loss_mask").to_pylist())
