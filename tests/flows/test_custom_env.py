"""docs/environments.md, exercised: its example environment module is written to a temporary
directory outside the package, put on sys.path, loaded by its ``module:factory`` spec, and used
where k3rl uses an environment: prompt streams (training and held-out), a real rollout of a tiny
K3 model, and the ``score_rewards`` stage (rewards and GRPO advantages in scored.parquet, checked
against the closed forms of the documented reward). A reward outside [0, 1] fails the stage with
the prompt named. (A full RL run with this environment, through ``k3rl run``:
tests/flows/test_ui_browser.py.)"""

from __future__ import annotations

import re
import sys

import pyarrow.parquet as pq
import pytest
import torch

from flows.deploy import PROJECT_ROOT
from k3core.rl.prompting import PromptFormat
from k3core.settings import GRPOSettings
from tasks.common import Run

SPEC = "uppercase_env:make_env"


def _rollouts(path, group_size: int):
    """A rollout table's handle, as the rollout stage gives it (the samples per prompt: its groups)."""
    from k3core.artifacts import Artifact, sha256_file

    return Artifact("rollouts", path.as_uri(), str(path), sha256_file(path), version=0, info={"group_size": group_size})


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    doc = (PROJECT_ROOT / "docs" / "environments.md").read_text()
    m = re.search(r"<!-- k3rl-test: uppercase_env.py -->\s*```python\n(.*?)```", doc, re.S)
    assert m, "docs/environments.md lost its tested example"
    outside = tmp_path / "my-envs"
    outside.mkdir()
    (outside / "uppercase_env.py").write_text(m.group(1))
    monkeypatch.syspath_prepend(str(outside))
    monkeypatch.delitem(sys.modules, "uppercase_env", raising=False)
    yield outside
    sys.modules.pop("uppercase_env", None)


def test_documented_env_loads_from_outside_the_package_and_scores_as_documented(env_module):
    from k3core.rl.envs import checked_reward, load_env

    env = load_env(SPEC)
    mod = sys.modules["uppercase_env"]
    assert mod.__file__.startswith(str(env_module)) and not mod.__file__.startswith(str(PROJECT_ROOT))
    assert env.reference("up:cab=") == "CAB"
    # the documented closed forms: 0.5 * share of capitals + 0.5 * share of positions right
    assert checked_reward(env, "up:cab=", "CAB", SPEC) == 1.0
    assert checked_reward(env, "up:cab=", " CAB ", SPEC) == 1.0
    assert checked_reward(env, "up:cab=", "CAX", SPEC) == pytest.approx(0.5 + 0.5 * 2 / 3)
    assert checked_reward(env, "up:cab=", "cab", SPEC) == 0.0
    assert checked_reward(env, "up:cab=", "CA", SPEC) == pytest.approx(0.5 + 0.5 * 2 / 3)
    assert checked_reward(env, "up:cab=", "", SPEC) == 0.0


def test_documented_env_through_rollout_and_the_scoring_stage(env_module, tmp_path):
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.data import heldout_prompts, is_heldout, training_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.tables import rollout_table
    from k3core.rl.weights import engine_from_model
    from k3core.rollout.engine import SamplingParams
    from k3core.tokenizer import ByteTokenizer
    from tasks.score import score_rewards

    env = load_env(SPEC)
    train = training_prompts(env, seed=0, iteration=0, n=4, spec=SPEC)
    held = heldout_prompts(env, seed=0, n=4, spec=SPEC)
    assert not any(map(is_heldout, train)) and all(map(is_heldout, held))
    assert all(re.fullmatch(r"up:[a-h]{2,5}=", p) for p in train + held)

    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    engine = engine_from_model(K3ForCausalLM(cfg).eval(), weight_version=0, quantized=False)
    tok = ByteTokenizer(cfg)
    group = 4
    table = rollout_table(engine, PromptFormat.of(tok, mode="raw"), train, SamplingParams(max_new_tokens=4, temperature=1.0, n=group, seed=0,
                                                             stop_token_ids=(tok.eos_id,)), iteration=0)
    path = tmp_path / "rollouts.parquet"
    pq.write_table(table, path)

    out = score_rewards.fn(Run(str(tmp_path / "artifacts"), "c", env=SPEC), 0, _rollouts(path, group), GRPOSettings())
    scored = pq.read_table(out.path).to_pylist()
    assert len(scored) == len(train) * group
    want = torch.tensor([env.reward(r["prompt"], r["completion"]) for r in scored])
    got = torch.tensor([r["reward"] for r in scored])
    torch.testing.assert_close(got, want.float())
    adv = torch.tensor([r["advantage"] for r in scored]).view(-1, group)
    g = want.float().view(-1, group)
    torch.testing.assert_close(adv, (g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + 1e-6))
    assert out.info["reward_mean"] == pytest.approx(float(want.mean()))
    # --scale-advantages false (Dr. GRPO): the reward minus its group's mean, not divided by the std
    out = score_rewards.fn(Run(str(tmp_path / "artifacts"), "c-unscaled", env=SPEC), 0, _rollouts(path, group),
                           GRPOSettings(scale_advantages=False))
    adv = torch.tensor([r["advantage"] for r in pq.read_table(out.path).to_pylist()]).view(-1, group)
    torch.testing.assert_close(adv, g - g.mean(1, keepdim=True))
    assert float(g.std(1).max()) > 0  # some group's rewards differ, so the two scalings are told apart


def test_a_reward_outside_0_1_fails_scoring_with_the_prompt(env_module, tmp_path):
    """User rewards run in the sandbox's worker processes, which import the module afresh: the broken
    reward is a module of its own, not a patch of this process's class."""
    import pyarrow as pa

    from k3core.rl.data import ROLLOUT_SCHEMA
    from tasks.score import score_rewards

    (env_module / "too_big_env.py").write_text("from uppercase_env import UppercaseEnv\n\n\n"
                                               "class TooBig(UppercaseEnv):\n"
                                               "    def reward(self, prompt, completion):\n"
                                               "        return 2.0\n\n\n"
                                               "def make_env():\n    return TooBig()\n")
    rows = {f.name: [] for f in ROLLOUT_SCHEMA}
    for i in range(2):
        for k, v in dict(iteration=0, prompt_index=0, sample_index=i, prompt="up:cab=", prompt_ids=[1], output_ids=[2],
                         completion="CAB", logprobs=[0.0], routing=[], finish_reason="length", weight_version=0,
                         worker="local", loss_mask=None, turns=None, token_versions=[0]).items():
            rows[k].append(v)
    path = tmp_path / "rollouts.parquet"
    pq.write_table(pa.table(rows, schema=ROLLOUT_SCHEMA), path)
    with pytest.raises(ValueError, match=r"too_big_env:make_env.*returned reward 2\.0 .*for prompt 'up:cab='"):
        score_rewards.fn(Run(str(tmp_path / "artifacts"), "c", env="too_big_env:make_env"), 0, _rollouts(path, 2),
                         GRPOSettings())
