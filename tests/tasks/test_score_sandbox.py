"""The scoring stage with a user environment, run as a Prefect task in a flow: completions that loop,
allocate 10 GB, fork without end, write outside their directory or connect out score 0 with the
reason in scored.parquet and the stage completes; a reward function that raises fails the stage
once, with no retry (the environment module is imported once per worker start, and a log of those
imports counts the attempts), naming the prompt."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from k3core.artifacts import Artifact, sha256_file
from k3core.rl.data import ROLLOUT_SCHEMA, SCORED_SCHEMA
from k3core.rl.rewards import RewardOutcome, merge_outcomes, outcome_table
from k3core.settings import GRPOSettings, RewardSettings
from tasks.common import RETRIES, Run
from tasks.score import score_fanout, score_rewards

SPEC = "hostile_reward_env:make"
TESTS = str(Path(__file__).resolve().parents[1])


def _rollouts(path: Path, prompt: str, completions: list[str]) -> Artifact:
    rows = {f.name: [] for f in ROLLOUT_SCHEMA}
    for i, c in enumerate(completions):
        for k, v in dict(iteration=0, prompt_index=i // 2, sample_index=i % 2, prompt=prompt, prompt_ids=[1],
                         output_ids=[2], completion=c, logprobs=[0.0], routing=[], finish_reason="length",
                         weight_version=0, worker="local", loss_mask=None, turns=None, token_versions=[0]).items():
            rows[k].append(v)
    pq.write_table(pa.table(rows, schema=ROLLOUT_SCHEMA), path)
    return Artifact("rollouts", path.as_uri(), str(path), sha256_file(path), version=0, info={"group_size": 2})


@flow(name="score-sandbox-test")
def _score(run: Run, rollouts: Artifact, reward: RewardSettings):
    return score_rewards(run, 0, rollouts, GRPOSettings(), reward)


def test_escaping_completions_score_zero_with_reasons_and_the_stage_completes(tmp_path, monkeypatch,
                                                                              prefect_harness):
    monkeypatch.syspath_prepend(TESTS)
    outside = tmp_path / "outside.txt"
    completions = ["ok", "loop", "alloc-10g", "fork-bomb", "write-outside", "resolve", "ok", "write-here"]
    rollouts = _rollouts(tmp_path / "rollouts.parquet", f"rev:abc=|{outside}", completions)
    out = _score(Run(str(tmp_path / "artifacts"), "sbx", env=SPEC), rollouts,
                 RewardSettings(timeout=2.0, workers=2, memory_mb=512, max_processes=6))
    table = pq.read_table(out.path)
    assert table.schema.equals(SCORED_SCHEMA)
    got = {c: (r, why.split(":")[0]) for c, r, why in zip(table["completion"].to_pylist(), table["reward"].to_pylist(),
                                                          table["reward_reason"].to_pylist())}
    assert got == {"ok": (0.5, ""), "loop": (0.0, "timeout"), "alloc-10g": (0.0, "memory"),
                   "fork-bomb": (0.0, "processes"), "write-outside": (0.0, "filesystem"),
                   "resolve": (0.0, "network"), "write-here": (1.0, "")}
    assert out.info["sandbox_stopped"] == 5
    assert not outside.exists()


def test_a_raising_reward_fails_the_stage_once_naming_the_prompt(tmp_path, monkeypatch, prefect_harness):
    assert RETRIES >= 1  # the stage is declared with retries, so "once" is a decision, not the default
    monkeypatch.syspath_prepend(TESTS)
    log = tmp_path / "imports.log"
    monkeypatch.setenv("K3RL_TEST_IMPORT_LOG", str(log))
    rollouts = _rollouts(tmp_path / "rollouts.parquet", "rev:xyz=|", ["ok", "raise"])
    with pytest.raises(ValueError, match=r"hostile_reward_env:make.*raised KeyError.*for prompt 'rev:xyz=\|'"):
        _score(Run(str(tmp_path / "artifacts"), "broken", env=SPEC), rollouts, RewardSettings(workers=1))
    assert len(log.read_text().splitlines()) == 1  # one attempt: one worker started, no retry


@flow(name="score-fanout-test", task_runner=ThreadPoolTaskRunner(max_workers=3))
def _score_fanout(run: Run, rollouts: Artifact, reward: RewardSettings, shards: int):
    return score_fanout(run, 0, rollouts, GRPOSettings(), reward, shards)


def test_fanned_out_scoring_equals_local_scoring(tmp_path, monkeypatch, prefect_harness):
    """Reward calls in 3 shards of 8 rows (2, 3 and 3 rows), each in a sandbox of its own, give the
    scored table of one local stage, row for row, a call the sandbox stopped included."""
    monkeypatch.syspath_prepend(TESTS)
    completions = ["ok", "write-here", "loop", "ok", "write-here", "ok", "ok", "write-here"]
    rollouts = _rollouts(tmp_path / "rollouts.parquet", "rev:abc=|x", completions)
    reward = RewardSettings(timeout=2.0, workers=1)
    want = pq.read_table(_score(Run(str(tmp_path / "local"), "sbx", env=SPEC), rollouts, reward).path)
    out = _score_fanout(Run(str(tmp_path / "fan"), "sbx", env=SPEC), rollouts, reward, 3)
    got = pq.read_table(out.path)
    assert got.equals(want)
    assert out.info["sandbox_stopped"] == 1 and got["reward_reason"][2].as_py().startswith("timeout")
    shards = sorted((tmp_path / "fan" / "runs" / "sbx" / "iter-0000" / "score-shards").glob("*.parquet"))
    assert [p.name for p in shards] == [f"shard-{k}-of-3.parquet" for k in range(3)]
    assert [pq.read_metadata(p).num_rows for p in shards] == [2, 3, 3]


def test_merged_reward_shards_refuse_missing_or_doubled_rows():
    a = outcome_table([RewardOutcome(0.5), RewardOutcome(0.0, "timeout: 2 s", True)], 0)
    b = outcome_table([RewardOutcome(1.0)], 2)
    assert merge_outcomes([b, a], 3) == [RewardOutcome(0.5), RewardOutcome(0.0, "timeout: 2 s", True),
                                         RewardOutcome(1.0)]
    with pytest.raises(ValueError, match=r"1 missing \(first \[2\]\), 0 doubled"):
        merge_outcomes([a], 3)
    with pytest.raises(ValueError, match="0 missing .*, 2 doubled"):
        merge_outcomes([a, a, b], 3)
