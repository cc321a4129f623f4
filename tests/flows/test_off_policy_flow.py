"""One-step-off-policy mode (``max_staleness`` 1) with the KL penalty to the frozen reference, end to
end on the tiny preset in Prefect's embedded mode: each batch records the version that sampled it
(iteration N trains on version N-1's batch), the reference stage publishes its table, and a run that
crashes with a batch sampled ahead but not yet trained resumes on that very batch (never sampled
again) and ends bit-identical to the uninterrupted run."""

import json
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from flows.pipeline import RLSettings, rl_run
from k3core.rl.data import REF_LOGPROBS_SCHEMA
from k3core.settings import SettingsError
from k3core.rl import engines, trainers

# the even-bytes environment of tests/even_bytes_env.py (crash injection included), under this test file's
# own module name
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()


def _settings(root: Path, run_id: str, **kw) -> RLSettings:
    base = dict(preset="tiny", source="init:tiny:3", env="flaky_even_for_tests:make", iterations=3,
                artifacts=str(root), run_id=run_id, prompts_per_iteration=4, samples_per_prompt=4,
                max_new_tokens=4, warmup_steps=3, warmup_batch=8, eval_prompts=8, eval_every=2, lr=1e-3,
                max_staleness=1, kl_coef=0.5)
    base.update(kw)
    return RLSettings.from_dict(base)


def _final_state(root: Path, run_id: str):
    from k3core.rl.trainer_state import load_trainer_state
    latest = json.loads((root / "runs" / run_id / "latest.json").read_text())
    path = Path(latest["checkpoint"].removeprefix("file://")) / "state"
    return latest, load_trainer_state(path, lr=0.0)[0].state_dict()


def _run_to_the_injected_crash(root: Path, run_id: str, **kw) -> Path:
    """A new "process" running until the scorer's injected crash; the run's directory."""
    engines.clear()
    trainers.clear()
    with pytest.raises(Exception, match="injected scorer crash"):
        rl_run(_settings(root, run_id, **kw))
    return root / "runs" / run_id


def _assert_same_final_state(tmp_path: Path, iterations: int) -> None:
    la, ma = _final_state(tmp_path / "a", "run-a")
    lb, mb = _final_state(tmp_path / "b", "run-b")
    assert la["iteration"] == lb["iteration"] == iterations
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k


def _versions(path: Path) -> set[int]:
    return set(pq.read_table(path, columns=["weight_version"]).column("weight_version").to_pylist())


@pytest.mark.slow
@pytest.mark.parametrize("updates", [{}, {"ppo_epochs": 2, "minibatches": 2}], ids=["one-update", "2x2-minibatches"])
def test_off_policy_run_resumes_on_the_batch_sampled_ahead(tmp_path, monkeypatch, prefect_harness, updates):
    """With minibatches the train step shuffles from the process's RNG while the rollout ahead runs in
    another thread: the runs must still agree bit for bit."""
    (tmp_path / "flaky_even_for_tests.py").write_text(ENV_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "crash-now"
    monkeypatch.setenv("K3RL_TEST_CRASH_FILE", str(marker))
    import k3core.rl.tables as tables

    calls = {"rollout": 0}
    threads: list[int] = []  # the thread of each rollout
    real_rollout = tables.rollout_table

    def counting_rollout(*a, **k):
        calls["rollout"] += 1
        threads.append(threading.get_ident())
        if calls["rollout"] == crash_at[0]:
            marker.write_text("crash")  # the next scorer to run (iteration 2's) raises
        return real_rollout(*a, **k)

    crash_at = [0]
    monkeypatch.setattr(tables, "rollout_table", counting_rollout)
    import k3core.rl.train as train

    train_threads: list[int] = []
    real_train = train.train_on_table
    monkeypatch.setattr(train, "train_on_table",
                        lambda *a, **k: train_threads.append(threading.get_ident()) or real_train(*a, **k))

    # A: uninterrupted
    engines.clear()
    trainers.clear()
    rl_run(_settings(tmp_path / "a", "run-a", **updates))
    root_a = tmp_path / "a" / "runs" / "run-a"
    assert calls["rollout"] == 3  # batches 0, 1 (both by version 0) and 2 (by version 1); none after the last
    # batch 0 is sampled in line by the flow; the batches sampled ahead run as submitted tasks, on the
    # task runner's worker threads, while the flow's thread goes on to the train step
    assert threads[0] in train_threads and not set(threads[1:]) & set(train_threads), (threads, train_threads)
    metrics = json.loads((root_a / "metrics.json").read_text())
    assert [m["staleness"] for m in metrics] == [0, 1, 1]
    assert [m["weight_version"] for m in metrics] == [0, 0, 1]
    assert [m["policy_version"] for m in metrics] == [0, 1, 2]
    for n, v in enumerate([0, 0, 1]):
        assert _versions(root_a / f"iter-{n:04d}" / "rollouts.parquet") == {v}
        ref = pq.read_table(root_a / f"iter-{n:04d}" / "ref-logprobs.parquet")
        assert ref.schema.equals(REF_LOGPROBS_SCHEMA) and ref.num_rows == 16
    # the reference is the starting policy: the first update is at the reference (k3 0 up to rounding),
    # later ones have moved away from it
    assert abs(metrics[0]["kl_ref_first"]) < 1e-5
    assert metrics[2]["kl_ref"] > 0
    assert all(m["seconds_rollout_ahead"] > 0 for m in metrics[:2]) and "seconds_rollout_ahead" not in metrics[2]

    # B: the scorer crashes in iteration 2, whose batch (sampled by version 1 during iteration 1) is
    # published and not yet trained
    calls["rollout"] = 0
    crash_at[0] = 3
    root_b = _run_to_the_injected_crash(tmp_path / "b", "run-b", **updates)
    assert calls["rollout"] == 3
    ahead = root_b / "iter-0002" / "rollouts.parquet"
    assert _versions(ahead) == {1} and not (root_b / "iter-0002" / "scored.parquet").exists()
    assert json.loads((root_b / "latest.json").read_text())["iteration"] == 2
    before = ahead.stat().st_mtime_ns

    # B again, a new "process": the batch sampled ahead is trained on, not sampled again
    marker.unlink()
    engines.clear()
    trainers.clear()
    rl_run(_settings(tmp_path / "b", "run-b", **updates))
    assert calls["rollout"] == 3, "the batch sampled ahead was sampled again"
    assert ahead.stat().st_mtime_ns == before
    metrics_b = json.loads((root_b / "metrics.json").read_text())
    assert [m["staleness"] for m in metrics_b] == [0, 1, 1]
    want = updates.get("ppo_epochs", 1) * updates.get("minibatches", 1)
    assert [m["updates"] for m in metrics_b] == [want] * 3
    assert pq.read_table(root_a / "iter-0002" / "scored.parquet").equals(pq.read_table(root_b / "iter-0002" / "scored.parquet"))
    _assert_same_final_state(tmp_path, 3)


@pytest.mark.slow
def test_staleness_two_trains_each_batch_two_versions_late_and_resumes_on_the_buffer_in_order(tmp_path, monkeypatch,
                                                                                              prefect_harness):
    """``--max-staleness 2``: iteration N trains on version max(0, N-2)'s batch, sampled two
    iterations ahead. A run killed with two batches sampled ahead and not trained (the buffer on
    disk) resumes on both, in order, sampling nothing again, and ends bit-identical."""
    (tmp_path / "flaky_even_for_tests.py").write_text(ENV_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "crash-now"
    monkeypatch.setenv("K3RL_TEST_CRASH_FILE", str(marker))
    import k3core.rl.tables as tables

    sampled: list[int] = []  # the iteration of each rollout
    real_rollout = tables.rollout_table

    def counting_rollout(client, fmt, prompts, params, iteration, *a, **k):
        sampled.append(iteration)
        if len(sampled) == crash_at[0]:
            marker.write_text("crash")  # the next reward call (iteration 2's evaluation) raises
        return real_rollout(client, fmt, prompts, params, iteration, *a, **k)

    crash_at = [0]
    monkeypatch.setattr(tables, "rollout_table", counting_rollout)
    kw = dict(max_staleness=2, iterations=4, kl_coef=0.0)
    engines.clear()
    trainers.clear()
    rl_run(_settings(tmp_path / "a", "run-a", **kw))
    root_a = tmp_path / "a" / "runs" / "run-a"
    # batch 0 in line; 2 ahead (version 0, in iteration 0); 1 in line by version 0; 3 ahead (version 1)
    assert sampled == [0, 2, 1, 3], sampled
    metrics = json.loads((root_a / "metrics.json").read_text())
    assert [m["staleness"] for m in metrics] == [0, 1, 2, 2]
    assert [m["weight_version"] for m in metrics] == [0, 0, 0, 1]
    for n, v in enumerate([0, 0, 0, 1]):
        assert _versions(root_a / f"iter-{n:04d}" / "rollouts.parquet") == {v}
    # the prompts move on by one batch per iteration, whichever iteration sampled the batch
    prompts = [pq.read_table(root_a / f"iter-{n:04d}" / "rollouts.parquet", columns=["prompt"]).column("prompt")
               .to_pylist() for n in range(4)]
    assert len({tuple(p) for p in prompts}) == 4

    # B: iteration 2 crashes (its evaluation's reward) once batch 3 is sampled: batches 2 and 3 are on disk, untrained
    sampled.clear()
    crash_at[0] = 4
    root_b = _run_to_the_injected_crash(tmp_path / "b", "run-b", **kw)
    assert sampled == [0, 2, 1, 3]
    buffer = [root_b / f"iter-{n:04d}" / "rollouts.parquet" for n in (2, 3)]
    assert [_versions(p) for p in buffer] == [{0}, {1}]
    assert not (root_b / "iter-0002" / "scored.parquet").exists()
    stamps = [p.stat().st_mtime_ns for p in buffer]

    marker.unlink()
    sampled.clear()
    engines.clear()
    trainers.clear()
    rl_run(_settings(tmp_path / "b", "run-b", **kw))
    assert sampled == [], "a batch of the buffer was sampled again"
    assert [p.stat().st_mtime_ns for p in buffer] == stamps
    assert [m["staleness"] for m in json.loads((root_b / "metrics.json").read_text())] == [0, 1, 2, 2]
    for n in range(4):
        assert pq.read_table(root_a / f"iter-{n:04d}" / "scored.parquet").equals(
            pq.read_table(root_b / f"iter-{n:04d}" / "scored.parquet")), n
    _assert_same_final_state(tmp_path, 4)


def test_a_negative_max_staleness_is_refused():
    with pytest.raises(SettingsError, match="--max-staleness must be >= 0, got -1"):
        RLSettings.from_dict({"max_staleness": -1})
    assert RLSettings.from_dict({"max_staleness": 4}).grpo.max_staleness == 4
    with pytest.raises(SettingsError, match="--kl-coef must be >= 0"):
        RLSettings.from_dict({"kl_coef": -0.1})
    s = RLSettings.from_dict({"grpo": {"max_staleness": 1, "kl_coef": 0.1}})
    assert (s.grpo.max_staleness, s.grpo.kl_coef) == (1, 0.1)


def test_cli_refuses_a_bad_max_staleness_with_exit_2(capsys):
    from flows.cli import main

    assert main(["run", "--preset", "tiny", "--max-staleness", "-3", "--kl-coef", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--max-staleness must be >= 0" in err and "--kl-coef must be >= 0" in err
