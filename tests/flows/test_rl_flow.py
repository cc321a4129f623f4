"""The RL flow end to end on the tiny preset, in Prefect's embedded mode: an uninterrupted run, and a
run that crashes mid-iteration (a user environment that raises) then resumes with the same run id,
skipping every finished stage and ending bit-identical to the uninterrupted run."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from flows.pipeline import RLSettings, rl_run
from k3core.rl.data import SCORED_SCHEMA
from k3core.rl import engines, trainers

# the even-bytes environment of tests/even_bytes_env.py (crash injection included), under this test file's
# own module name
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()


def _settings(root: Path, run_id: str, **kw) -> RLSettings:
    base = dict(preset="tiny", source="init:tiny:3", env="flaky_env_for_tests:make", iterations=2,
                artifacts=str(root), run_id=run_id, prompts_per_iteration=4, samples_per_prompt=4,
                max_new_tokens=4, warmup_steps=3, warmup_batch=8, eval_prompts=8, eval_every=1, lr=1e-3,
                mismatch_every=1)
    base.update(kw)
    return RLSettings.from_dict(base)


def _final_model(root: Path, run_id: str):
    from k3core.rl.trainer_state import load_trainer_state
    latest = json.loads((root / "runs" / run_id / "latest.json").read_text())
    path = Path(latest["checkpoint"].removeprefix("file://")) / "state"
    return latest, load_trainer_state(path, lr=0.0)[0].state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("updates", [{}, {"ppo_epochs": 2, "minibatches": 2, "mismatch_every": 2}],
                         ids=["one-update", "2x2-minibatches"])
def test_rl_run_resumes_after_crash_and_matches_uninterrupted(tmp_path, monkeypatch, prefect_harness, updates):
    """With minibatch updates the batch is reshuffled from the trainer's RNG: a resumed run must still
    draw the same shuffles as an uninterrupted one."""
    (tmp_path / "flaky_env_for_tests.py").write_text(ENV_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "crash-now"
    monkeypatch.setenv("K3RL_TEST_CRASH_FILE", str(marker))

    # count every read of a trainer state (DCP) from here on
    import k3core.rl.trainer_state as trainer_state

    reads = []
    real_load = trainer_state.load_trainer_state
    monkeypatch.setattr(trainer_state, "load_trainer_state", lambda *a, **k: reads.append(a[0]) or real_load(*a, **k))

    # A: uninterrupted; a continuing run never reads its trainer state back (it stays live in the process)
    engines.clear()
    trainers.clear()
    sa = rl_run(_settings(tmp_path / "a", "run-a", **updates))
    assert sa["iterations"] == 2
    assert reads == []

    # B: the scorer crashes in iteration 1 (after iteration 0 and rollout 1 finished)
    import k3core.rl.tables as stages

    calls = {"rollout": 0}
    real_rollout = stages.rollout_table

    def counting_rollout(*a, **k):
        calls["rollout"] += 1
        if calls["rollout"] == 2:
            marker.write_text("crash")  # the scorer of iteration 1 will raise
        return real_rollout(*a, **k)

    monkeypatch.setattr(stages, "rollout_table", counting_rollout)
    engines.clear()
    trainers.clear()
    with pytest.raises(Exception, match="injected scorer crash"):
        rl_run(_settings(tmp_path / "b", "run-b", **updates))
    assert calls["rollout"] == 2
    root_b = tmp_path / "b" / "runs" / "run-b"
    assert (root_b / "iter-0000" / "scored.parquet").exists()
    assert (root_b / "iter-0001" / "rollouts.parquet").exists()
    assert not (root_b / "iter-0001" / "scored.parquet").exists()
    assert json.loads((root_b / "latest.json").read_text())["iteration"] == 1  # the crash kept latest intact
    rollouts_before = (root_b / "iter-0001" / "rollouts.parquet").stat().st_mtime_ns

    # B again: a new "process" (no live engine or trainer), same run id; the crash is gone
    marker.unlink()
    engines.clear()
    trainers.clear()
    reads.clear()
    sb = rl_run(_settings(tmp_path / "b", "run-b", **updates))
    # the resumed iteration reads its trainer state once (the mismatch metric reads it, the train step
    # takes it over), and nothing else is read back. Iteration 0 was not on record (its state was
    # written beside iteration 1's rollout, which crashed before the join), so it is re-run: every stage
    # finds its work, and version 1 is read from the train step's own directory (the checkpoint's files
    # are hard links of it)
    assert [Path(r).parent.as_posix().rsplit("/", 2)[-2:] for r in reads] in (
        [["iter-0000", "trainer"]], [["checkpoints", "iter-0001"]]), reads
    assert calls["rollout"] == 2, "finished rollouts were recomputed"
    assert (root_b / "iter-0001" / "rollouts.parquet").stat().st_mtime_ns == rollouts_before

    # run B once more: a finished run is not replayed (no stage body runs, no trainer state is read) and
    # its records stay as they were
    metrics_before = (root_b / "metrics.json").read_text()
    engines.clear()
    trainers.clear()
    reads.clear()
    again = rl_run(_settings(tmp_path / "b", "run-b", **updates))
    assert reads == [] and calls["rollout"] == 2
    assert again["heldout_reward_end"] == sb["heldout_reward_end"]
    assert (root_b / "metrics.json").read_text() == metrics_before

    la, ma = _final_model(tmp_path / "a", "run-a")
    lb, mb = _final_model(tmp_path / "b", "run-b")
    assert la["iteration"] == lb["iteration"] == 2
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    ta = pq.read_table(tmp_path / "a" / "runs" / "run-a" / "iter-0001" / "scored.parquet")
    tb = pq.read_table(root_b / "iter-0001" / "scored.parquet")
    assert ta.schema.equals(SCORED_SCHEMA) and ta.equals(tb)
    assert sa["heldout_reward_end"] == sb["heldout_reward_end"]
    metrics = json.loads((root_b / "metrics.json").read_text())
    assert all(m.get("skipped", 1.0) == 0.0 for m in metrics), "an iteration took no optimizer step"
    want = updates.get("ppo_epochs", 1) * updates.get("minibatches", 1)
    assert [m["updates"] for m in metrics] == [want, want]
    summary = json.loads((root_b / "summary.json").read_text())
    assert set(summary["seconds_per_stage"]) >= {"rollout", "score", "train", "save", "transfer"}
    ratios = sorted(m["mismatch_kl_ratio"] for m in metrics if m.get("mismatch_kl_ratio") is not None)
    assert summary["qat"] is False
    if updates.get("mismatch_every", 1) == 2:  # measured at iteration 0 only
        assert ["mismatch_seconds" in m for m in metrics] == [True, False]
        assert len(ratios) == 1 and summary["mismatch_kl_ratio_median"] == ratios[0]
    else:
        assert len(ratios) == 2 and summary["mismatch_kl_ratio_median"] == (ratios[0] + ratios[1]) / 2
