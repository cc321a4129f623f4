"""A dataset environment through the real RL flow (tiny preset, Prefect embedded mode): a run that
is interrupted in iteration 1 and resumed reads exactly the prompts an uninterrupted run reads, in
every dynamic-sampling round. The reference is the dataset's own stream (``prompts_at``) walked by the
number of rounds each iteration actually sampled, and the data cursor every checkpoint records. Also
in one-step-off-policy mode, where iteration N+1's first round is sampled during iteration N, from
the position iteration N's rounds end at."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.pipeline import RLSettings, rl_run
from k3core.rl.envs import load_env
from k3core.rl import engines, trainers

N = 4  # prompts per round
SEED = 5


def _settings(root: Path, run_id: str, staleness: int) -> RLSettings:
    return RLSettings.from_dict(dict(
        preset="tiny", source="init:tiny:3", env="math", seed=SEED, iterations=3, artifacts=str(root), run_id=run_id,
        prompts_per_iteration=N, samples_per_prompt=2, max_new_tokens=3, warmup_steps=0, eval_prompts=4,
        eval_every=0, mismatch_sequences=0, refill_rounds=1, lr=1e-3, reward_workers=1, max_staleness=staleness,
        keep_checkpoints=0))  # every checkpoint stays: the test reads the data cursor of each


def _rounds(run_root: Path, iteration: int) -> list[list[str]]:
    """The prompts of each sampling round of an iteration, one per group, in round order."""
    d = run_root / f"iter-{iteration:04d}"
    files = [d / "rollouts.parquet"] + sorted(d.glob("rollouts-refill*.parquet"))
    return [pq.read_table(f, columns=["prompt"]).column("prompt").to_pylist()[::2] for f in files if f.exists()]


def _cursor(run_root: Path, version: int) -> int:
    extra = run_root / "checkpoints" / f"iter-{version:04d}" / "state" / "extra.json"
    return json.loads(extra.read_text())["data_cursor"]["position"]


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "one-step-off-policy"])
def test_a_resumed_dataset_run_reads_the_prompts_an_uninterrupted_one_reads(tmp_path, monkeypatch, prefect_harness,
                                                                           staleness):
    env = load_env("math")

    engines.clear()
    trainers.clear()
    rl_run(_settings(tmp_path / "a", "run-a", staleness))
    root_a = tmp_path / "a" / "runs" / "run-a"
    rounds_a = [_rounds(root_a, i) for i in range(3)]

    # the reference: the dataset's stream, each round at the position the rounds before it reached
    position = 0
    for i, rounds in enumerate(rounds_a):
        for r, prompts in enumerate(rounds):
            assert prompts == env.prompts_at(SEED, position, N), (i, r)
            position += N
        assert _cursor(root_a, i + 1) == position  # the checkpoint records where the next iteration starts
    assert any(len(r) > 1 for r in rounds_a), "no refill round: the cursor would equal iteration x N"

    # B: interrupted at the rollout of iteration 1 (iteration 0 trained and checkpointed), then resumed
    import k3core.rl.tables as tables

    real_rollout, calls = tables.rollout_table, {"n": 0}

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == len(rounds_a[0]) + 1:
            raise ValueError("injected interruption")
        return real_rollout(*a, **k)

    monkeypatch.setattr(tables, "rollout_table", interrupted)
    engines.clear()
    trainers.clear()
    with pytest.raises(Exception, match="injected interruption"):
        rl_run(_settings(tmp_path / "b", "run-b", staleness))
    root_b = tmp_path / "b" / "runs" / "run-b"
    assert not (root_b / "iter-0001" / "rollouts.parquet").exists()

    monkeypatch.setattr(tables, "rollout_table", real_rollout)
    engines.clear()  # a new process: nothing live, the cursor comes from the checkpoint
    trainers.clear()
    rl_run(_settings(tmp_path / "b", "run-b", staleness))
    assert [_rounds(root_b, i) for i in range(3)] == rounds_a
    assert [_cursor(root_b, v) for v in (1, 2, 3)] == [_cursor(root_a, v) for v in (1, 2, 3)]
    for root in (root_a, root_b):
        metrics = json.loads((root / "metrics.json").read_text())
        assert [m["staleness"] for m in metrics] == [0, staleness, staleness]
    scored = pq.read_table(root_b / "iter-0002" / "scored.parquet")
    assert "reward_reason" in scored.column_names
