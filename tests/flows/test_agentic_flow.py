"""`k3rl run --env tools-calc` on a checkpoint with the bundled BPE, tiny preset, Prefect's embedded
mode: every stage carries multi-turn trajectories. Rollout rows hold episodes whose assistant spans
are trained (mask 1, with their sampling log-probabilities) and whose tool results are not (mask 0,
log-probability 0), and whose ids after each assistant turn are exactly the rendering of what the
calculator answered; the iteration's metrics carry the tool-use figures, recomputed here from the
rows; the trajectory viewer is a Prefect markdown artifact per iteration; and running the same
command again replays no finished episode (no rollout file is rewritten)."""

import json

import pyarrow.parquet as pq
import pytest

from flows.pipeline import RLSettings, rl_run
from k3core.rl import engines, trainers
from k3core.rl.envs import ToolsCalcEnv
from k3core.tokenizer import load_tokenizer


def _settings(tmp_path):
    return RLSettings.from_dict(dict(preset="tiny", source="init:tiny:0:bpe", env="tools-calc", iterations=2,
                                     artifacts=str(tmp_path), run_id="agent", prompts_per_iteration=4,
                                     samples_per_prompt=2, max_new_tokens=40, max_turns=2, max_episode_tokens=96,
                                     warmup_steps=120, warmup_batch=8, warmup_lr=3e-3, eval_prompts=2, eval_every=0,
                                     mismatch_sequences=0))


@pytest.mark.slow
def test_tools_calc_episodes_through_every_stage(tmp_path, prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    engines.clear()
    trainers.clear()
    s = _settings(tmp_path)
    summary = rl_run(s)
    run = tmp_path / "runs" / "agent"
    tok = load_tokenizer(run / "tokenizer")
    env = ToolsCalcEnv()
    rows = [r for it in ("iter-0000", "iter-0001") for r in pq.read_table(run / it / "scored.parquet").to_pylist()]
    assert len(rows) == 16
    tool_calls = 0
    for r in rows:
        mask, lps, ids = r["loss_mask"], r["logprobs"], r["output_ids"]
        assert len(mask) == len(lps) == len(ids) and mask[0] == 1 and mask[-1] == 1
        turns = json.loads(r["turns"])
        for t in turns:
            lo, hi = t["span"]
            if lo == hi:  # the answers after the last turn of an episode cut by --max-turns: not in its ids
                assert hi == len(ids) and t["role"] != "assistant"
                continue
            if t["role"] == "assistant":
                assert set(mask[lo:hi]) == {1} and all(lp < 0 for lp in lps[lo:hi])
                assert tok.decode(ids[lo:hi]).startswith(t["text"])
            else:
                assert set(mask[lo:hi]) == {0} and set(lps[lo:hi]) == {0.0}
            if t["role"] == "tool":  # the calculator really ran on the sampled arguments, and the model read its answer
                tool_calls += 1
                # a sampled name may be misspelt: the runner answers that, naming the declared tools
                expected = (env.call_tool(r["prompt"], "calculator", json.loads(t["arguments"])) if t["name"] == "calculator"
                            else f"error: unknown tool {t['name']!r}; the tools are ['calculator']")
                assert t["result"] == expected
                assert t["result"] in tok.decode(ids[lo:hi])
        assert r["reward"] == pytest.approx(env.reward(r["prompt"], r["completion"]), abs=1e-6)  # stored as float32
    assert tool_calls > 0  # the warm-up taught the call
    metrics = json.loads((run / "metrics.json").read_text())
    for m, it in zip(metrics, ("iter-0000", "iter-0001")):
        part = pq.read_table(run / it / "scored.parquet").to_pylist()
        calls = sum(t["role"] == "tool" for r in part for t in json.loads(r["turns"]))
        assert m["tool_calls_per_episode"] == calls / len(part)
        assert m["episode_tokens"] == sum(len(r["output_ids"]) for r in part) / len(part)
    with get_client(sync_client=True) as client:
        viewer = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rl-trajectories-agent"])))
    assert len(viewer) == 2 and all("**assistant**" in a.data and "reward" in a.data for a in viewer)
    # the same command again: the finished run replays nothing
    stamps = {p: p.stat().st_mtime_ns for p in run.glob("iter-*/rollouts.parquet")}
    engines.clear()
    trainers.clear()
    assert rl_run(s)["iterations"] == summary["iterations"] == 2
    assert {p: p.stat().st_mtime_ns for p in run.glob("iter-*/rollouts.parquet")} == stamps


@pytest.mark.slow
def test_an_external_harness_trains_through_every_stage(tmp_path, prefect_harness, monkeypatch):
    """The documented harness (``docs/environments.md``: an ``openai`` agent loop) as
    ``--env calc_harness:make_env``: its episodes reach the rollout table through the embedded engine
    served on 127.0.0.1, are scored in the sandbox, trained (the policy moves) and evaluated."""
    import re
    from pathlib import Path

    pytest.importorskip("openai", reason="harness environments need the test extra (openai)")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    src = re.search(r"<!-- k3rl-test: calc_harness.py -->\s*```python\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "calc_harness.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path / "envs"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "envs"))
    engines.clear()
    trainers.clear()
    s = RLSettings.from_dict(dict(preset="tiny", source="init:tiny:0:bpe", env="calc_harness:make_env", iterations=2,
                                  artifacts=str(tmp_path / "a"), run_id="harness", prompts_per_iteration=3,
                                  samples_per_prompt=2, max_new_tokens=16, warmup_steps=0, eval_prompts=2,
                                  eval_every=1, mismatch_sequences=0))
    summary = rl_run(s)
    assert summary["iterations"] == 2
    run = tmp_path / "a" / "runs" / "harness"
    for it in ("iter-0000", "iter-0001"):
        rows = pq.read_table(run / it / "scored.parquet").to_pylist()
        assert len(rows) == 6 and {r["weight_version"] for r in rows} == {int(it[-1])}
        for r in rows:
            assert json.loads(r["turns"])[0]["role"] == "assistant" and r["loss_mask"][0] == 1
            assert 0.0 <= r["reward"] <= 1.0
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics) == 2 and all(0.0 <= m["heldout_greedy_reward"] <= 1.0 for m in metrics)
