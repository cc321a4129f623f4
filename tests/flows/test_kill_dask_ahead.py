"""Kill -9 of the whole run while a Dask worker writes a shard of the batch sampled ahead.

``k3rl run --task-runner dask --rollout-workers 2 --max-staleness 1`` (real processes, tiny preset):
during iteration 0 the workers sample iteration 1's batch. ``K3RL_FAULT=rollout-iter1-shard0-of-2:
mid-write`` with ``K3RL_FAULT_SCOPE=group`` (``k3core/faults.py``) makes the worker writing that
shard SIGKILL the run's whole process group with the shard half written in its staging path: the
flow process, its embedded Prefect server, the Dask scheduler and both workers die at once, as in a
power cut. The same command, run again, resumes and ends equal to an uninterrupted run: the same
rollout and score tables in every iteration (which worker served a shard aside), the same weights,
no staging path left, and no artifact published before the kill written again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FAULT = "rollout-iter1-shard0-of-2:mid-write"
ARGS = ["run", "--preset", "tiny", "--source", "init:tiny:3", "--env", "even_bytes_env:make", "--iterations", "2",
        "--prompts-per-iteration", "4", "--samples-per-prompt", "2", "--max-new-tokens", "3", "--warmup-steps", "1",
        "--warmup-batch", "4", "--eval-prompts", "4", "--eval-every", "0", "--mismatch-sequences", "0", "--lr", "1e-3",
        "--keep-checkpoints", "0", "--task-runner", "dask", "--rollout-workers", "2", "--max-staleness", "1",
        "--run-id", "ahead"]


def _k3rl(artifacts: Path, home: Path, fault: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_API_") and k not in ("K3RL_FAULT", "K3RL_FAULT_SCOPE")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), PREFECT_HOME=str(home),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    if fault:
        env.update(K3RL_FAULT=fault, K3RL_FAULT_SCOPE="group")
    # a session of its own: the group kill takes this run's processes and nothing of the test's
    p = subprocess.Popen([sys.executable, "-m", "flows.cli", *ARGS, "--artifacts", str(artifacts)], cwd=ROOT, env=env,
                         start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out)


def _published(run: Path) -> dict[str, tuple[int, int]]:
    pointers = {"latest.json", "metrics.json", "lineage.json", "summary.json"}
    return {str(p.relative_to(run)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in run.rglob("*")
            if p.is_file() and p.name not in pointers and not any(s.startswith(".") for s in p.relative_to(run).parts)}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from k3core.rl.trainer_state import load_trainer_state

    latest = json.loads((run / "latest.json").read_text())
    model, _, _ = load_trainer_state(Path(latest["checkpoint"].removeprefix("file://")) / "state", lr=0.0)
    return model.state_dict()


def _table(path: Path):
    t = pq.read_table(path)
    return t.drop_columns([c for c in ("worker",) if c in t.column_names])


@pytest.mark.slow  # three tiny Dask runs of two iterations, each with its own cluster and Prefect server: ~1 min
def test_a_power_cut_mid_shard_of_the_batch_ahead_resumes_equal(tmp_path):
    base = _k3rl(tmp_path / "base", tmp_path / "home-base", None)
    assert base.returncode == 0, base.stdout[-3000:]

    killed = _k3rl(tmp_path / "cut", tmp_path / "home-cut", FAULT)
    assert killed.returncode == -9, f"expected the group SIGKILL, got {killed.returncode}\n{killed.stdout[-3000:]}"
    run = tmp_path / "cut" / "runs" / "ahead"
    staged = [p for p in (run / "iter-0001").rglob(".tmp-*")]
    assert staged, "the shard was not caught mid-write"
    assert not (run / "iter-0001" / "scored.parquet").exists()
    before = _published(run)

    resumed = _k3rl(tmp_path / "cut", tmp_path / "home-cut", None)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert not [p for p in run.rglob("*") if p.name.startswith((".tmp-", ".dl-"))], "staging paths left behind"
    after = _published(run)
    assert {k: after.get(k) for k in before} == before, "an artifact published before the kill was written again"

    ref = tmp_path / "base" / "runs" / "ahead"
    for n in range(2):
        for name in ("rollouts.parquet", "scored.parquet"):
            assert _table(run / f"iter-{n:04d}" / name).equals(_table(ref / f"iter-{n:04d}" / name)), (n, name)
    got, want = _weights(run), _weights(ref)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
