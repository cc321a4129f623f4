"""Kill -9 at every stage: real ``k3rl run`` processes (``python -m flows.cli``, tiny preset) SIGKILLed by
``K3RL_FAULT=<stage>:<point>`` (``k3core/faults.py``), then resumed by the same command. The table of
docs/reliability.md ("Kill -9 at every stage") is this file.

Each recovery is tested once per stage, in two chains. A chain's first process is killed at its
point in the first stage; the same command, run again, resumes and is killed at the point of the
next stage, and so on through every stage of the run in the order the run reaches them; a last,
unarmed run of the command finishes. So every kill is followed by a resume, and each chain costs
one process per stage.

- ``staging``: every stage that publishes a file, killed with its artifact in staging, alternately
  ``mid-write`` (half written) and ``before-publish`` (complete, not renamed). Both leave a staging
  path of the dead pid and nothing published, and a resume recovers from both the same way: it
  removes the staging path and runs the stage again. Each process runs Prefect's embedded server.
- ``after-publish``: every stage, killed after its body returned (published, not recorded by
  Prefect), so the resume must find the finished work instead of redoing it. Its processes report
  to one ``prefect server start`` for the test session (``PREFECT_API_URL``), as a deployment's
  would: a server that outlives the killed process must see its flow runs marked Crashed too. The
  baseline and the chains around the background save report to that server as well (the staging
  chain is the one that tests the embedded server).

After every kill, and after the resume that follows it:

- the killed process got SIGKILL at the point (exit -9), and left what that point leaves: a staging
  path (``.tmp-*``) of its pid for ``mid-write`` and ``before-publish``;
- its embedded Prefect server, where it ran one, is gone (no process serving this chain's
  PREFECT_HOME remains);
- the resume took over the run's lock from the killed pid and said so, removed every staging path
  the killed process left, and marked the killed process's flow runs Crashed (in Prefect's database);
- no artifact published before the kill was written again (same inode, same mtime): no rollout,
  score table, trainer state or checkpoint is regenerated.

At the end of each chain the run equals an uninterrupted run of the same command (the module's
baseline): the same weights, optimizer state, torch RNG state and data cursor in the last trainer
state, the same rollout and score tables, the same metrics (timings and memory peaks aside), no
staging path anywhere and no flow run left unfinished."""

from __future__ import annotations

import json
import os
import sqlite3
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "kill"
# the smallest run that reaches every stage, iteration 1 resumed from iteration 0's checkpoint; two
# minibatches, so that the trainer's RNG (their shuffle) decides the weights
ARGS = ["run", "--preset", "tiny", "--source", "init:tiny:3", "--env", "even_bytes_env:make", "--iterations", "2",
        "--prompts-per-iteration", "2", "--samples-per-prompt", "2", "--max-new-tokens", "3", "--warmup-steps", "1",
        "--warmup-batch", "4", "--eval-prompts", "4", "--eval-every", "1", "--lr", "1e-3", "--minibatches", "2",
        "--keep-checkpoints", "0", "--mismatch-every", "1", "--run-id", RUN_ID]
# every checkpoint kept: a deleted one would read as rewritten; the mismatch stage in both iterations
# every stage, in the order the run reaches them; kills in iteration 1 resume a run that has a
# finished iteration and a live trainer and engine that the killed process lost
PUBLISHING = ["fetch_checkpoint", "validate_checkpoint", "warmup", "quantize_mxfp4", "rollout-iter1",
              "score_rewards-iter1", "save_checkpoint-iter1"]
ALL_STAGES = ["fetch_checkpoint", "validate_checkpoint", "warmup", "quantize_mxfp4", "rollout-iter1",
              "score_rewards-iter1", "rollout_mismatch-iter1", "train_step-iter1", "save_checkpoint-iter1",
              "transfer_weights-iter1", "evaluate-final"]
STAGING_POINTS = ("mid-write", "before-publish")
CHAINS = {"staging": [(stage, STAGING_POINTS[i % 2]) for i, stage in enumerate(PUBLISHING)],
          "after-publish": [(stage, "after-publish") for stage in ALL_STAGES]}
# rewritten on purpose by every run (pointers and reports, replaced atomically): not published artifacts
POINTERS = {"latest.json", "metrics.json", "lineage.json", "summary.json"}
SERVER_APP = b"prefect.server.api.server:create_app"


def _k3rl(artifacts: Path, home: Path, fault: str | None, api: str | None = None, extra: tuple[str, ...] = ()
          ) -> tuple[subprocess.CompletedProcess, int]:
    """Run the command once (``fault``: the K3RL_FAULT value, None: unarmed; ``api``: the Prefect
    server to report to, None: the process's own embedded server in ``home``); (result, pid)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_") and k != "K3RL_FAULT"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), PREFECT_HOME=str(home),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    if api:
        env["PREFECT_API_URL"] = api
    if fault:
        env["K3RL_FAULT"] = fault
    # SIGINT as a terminal delivers it: a suite started in the background of a non-interactive shell
    # inherits SIGINT ignored, and the run under test would inherit that too (its SIGINT tests then fail)
    p = subprocess.Popen([sys.executable, "-m", "flows.cli", *ARGS, *extra, "--artifacts", str(artifacts)], cwd=ROOT,
                         env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=600)
    finally:
        if p.poll() is None:  # the test failed or timed out around it: do not leave the run going
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out), p.pid


def _servers(home: Path) -> list[int]:
    """Pids of live embedded Prefect servers serving ``home`` (other sessions' servers are not ours)."""
    mark = f"PREFECT_HOME={home}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if SERVER_APP in (d / "cmdline").read_bytes() and mark in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def _no_server_left(home: Path) -> None:
    """The kernel kills the server when its parent dies; give it a moment to be reaped."""
    for _ in range(100):
        if not _servers(home):
            return
        time.sleep(0.1)
    raise AssertionError(f"embedded Prefect server(s) {_servers(home)} outlived their k3rl process")


def _staging(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*") if p.name.startswith((".tmp-", ".dl-")))


def _published(run: Path) -> dict[str, tuple[int, int]]:
    """Every published file of the run: relative path -> (inode, mtime_ns)."""
    out = {}
    for p in run.rglob("*"):
        rel = p.relative_to(run)
        if p.is_file() and p.name not in POINTERS and not any(part.startswith(".") for part in rel.parts):
            st = p.stat()
            out[str(rel)] = (st.st_ino, st.st_mtime_ns)
    return out


def _flow_runs(home: Path) -> dict[str, tuple[str, str]]:
    """Prefect's flow runs in ``home``'s database: id -> (name, state type)."""
    con = sqlite3.connect(home / "prefect.db")
    try:
        return {i: (n, s) for i, n, s in con.execute("SELECT id, name, state_type FROM flow_run")}
    finally:
        con.close()


def _final_state(root: Path) -> dict:
    from k3core.rl.trainer_state import load_trainer_state

    run = root / "runs" / RUN_ID
    latest = json.loads((run / "latest.json").read_text())
    model, opt, extra = load_trainer_state(Path(latest["checkpoint"].removeprefix("file://")) / "state", lr=0.0)
    return {"iteration": latest["iteration"], "model": model.state_dict(), "optim": opt.state_dict(),
            # torch's RNG draws the trainer's minibatch shuffles. Python's global RNG, saved beside it,
            # is not compared: the trainer draws nothing from it, and Prefect's client threads draw
            # from it (retry and reconnect jitter) whenever the server is slow, in any run.
            "rng": torch.get_rng_state(), "extra": {k: extra[k] for k in ("iteration", "data_cursor", "metrics")},
            "metrics": json.loads((run / "metrics.json").read_text()),
            "tables": {f"{it}/{t}": pq.read_table(run / it / t) for it in ("iter-0000", "iter-0001")
                       for t in ("rollouts.parquet", "scored.parquet")}}


def _measured(key) -> bool:
    """Metrics that measure the process (wall time, rates, memory peaks), not the run's state."""
    return isinstance(key, str) and ("seconds" in key or key.endswith("_per_s") or key.startswith("memory_"))


def _drop_timings(x):
    if isinstance(x, dict):
        return {k: _drop_timings(v) for k, v in x.items() if not _measured(k)}
    if isinstance(x, list):
        return [_drop_timings(v) for v in x]
    return x


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "equals"):  # pyarrow tables
        assert a.equals(b), where
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def baseline(kill_matrix_baseline):
    """The same command, never killed (reporting to the session's server: no embedded one to start;
    run once per test session, tests/conftest.py)."""
    return kill_matrix_baseline


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("chain", list(CHAINS))
def test_kill_at_every_stage_then_resume_equals_an_uninterrupted_run(chain, baseline, tmp_path, request):
    artifacts, run = tmp_path / "artifacts", tmp_path / "artifacts" / "runs" / RUN_ID
    if chain == "after-publish":  # the session's server: its database holds the flow runs
        server = request.getfixturevalue("prefect_server")
        api, home = server.api, server.home
    else:  # each process's own embedded server, in this chain's PREFECT_HOME
        api, home = None, tmp_path / "prefect-home"
    at_start = set(_flow_runs(home)) if (home / "prefect.db").exists() else set()  # other tests' flow runs
    killed_pid, killed_flow_runs = None, set()
    for target, point in [*CHAINS[chain], (None, None)]:
        published = _published(run) if run.exists() else {}
        before = _flow_runs(home) if (home / "prefect.db").exists() else {}
        done, pid = _k3rl(artifacts, home, f"{target}:{point}" if target else None, api)
        step = f"{target}:{point}" if target else "the final resume"
        log = done.stdout[-4000:]

        # what this process did as the resume of the previous kill
        if killed_pid is not None:
            assert f"from pid {killed_pid}, which died holding it" in done.stdout, f"{step}: no lock takeover\n{log}"
            assert not [p for p in _staging(run) if p.name.split(".")[-2] == str(killed_pid)], (
                f"{step}: staging of the killed pid {killed_pid} survived: {_staging(run)}")
            states = _flow_runs(home)
            assert {states[i][1] for i in killed_flow_runs} == {"CRASHED"}, (
                f"{step}: the killed process's flow runs are {[states[i] for i in killed_flow_runs]}")
        changed = {k for k, v in published.items() if _published(run).get(k) != v}
        assert not changed, f"{step}: published artifacts were written again: {sorted(changed)}"

        if target is None:
            assert done.returncode == 0, f"the final resume failed:\n{log}"
            break
        # the kill itself
        assert done.returncode == -9, f"{step}: expected SIGKILL at the fault point, got {done.returncode}\n{log}"
        assert (run / ".lock").read_text().strip() == f"pid {pid}"  # the dead holder's record, for the takeover
        staged = [p for p in _staging(run) if p.name.split(".")[-2] == str(pid)]
        if point != "after-publish":
            assert staged, f"{step}: the kill left no staging path of pid {pid}"
        if api is None:
            _no_server_left(home)
        after = _flow_runs(home)
        killed_flow_runs = {i for i, (_, s) in after.items() if s == "RUNNING" and i not in before}
        assert killed_flow_runs, f"{step}: the killed process left no Running flow run to mark"
        killed_pid = pid

    if api is None:
        _no_server_left(home)
    assert _staging(run) == []
    states = _flow_runs(home)
    assert {s for i, (_, s) in states.items() if i not in at_start} <= {"COMPLETED", "CRASHED"}
    final = _final_state(artifacts)
    assert final["iteration"] == baseline["iteration"] == 2
    _assert_same(_drop_timings(final), _drop_timings(baseline))


# Kills that the chains above cannot reach in a fixed order: iteration 0's trainer state is written in
# a thread beside iteration 1's rollout (which of the two finishes first is up to the scheduler), and
# with --save-every 2 the state after iteration 0 is never written. Each chain: its kills in turn, each
# resumed by the next run, then an unarmed run.
BEHIND = {
    # the background save killed with the trainer state half written in staging (the resume retrains
    # iteration 0 from its published tables, and finds iteration 1's rollout if it was published);
    # that resume's own background save then killed after it published state 1, its checkpoint and
    # latest.json, before the flow recorded iteration 0 (the last resume finds both and records it)
    "background-save": (["save_checkpoint-iter0:mid-write", "save_checkpoint-iter0:after-publish"], ()),
    # --save-every 2: killed in iteration 1 while state 1 lives only in the dead process; the resume
    # re-runs iteration 0's train step from its published tables (no trainer state is on disk yet)
    "save-every-2": (["score_rewards-iter1:mid-write"], ("--save-every", "2")),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(BEHIND))
def test_a_kill_around_the_background_save_or_between_saves_resumes_equal(case, baseline, tmp_path, prefect_server):
    faults, extra = BEHIND[case]
    artifacts, run, home = tmp_path / "artifacts", tmp_path / "artifacts" / "runs" / RUN_ID, tmp_path / "prefect-home"
    killed_pid = None
    for fault in [*faults, None]:
        published = _published(run) if run.exists() else {}
        done, pid = _k3rl(artifacts, home, fault, prefect_server.api, extra=extra)
        log = done.stdout[-4000:]
        if killed_pid is not None:
            assert f"from pid {killed_pid}, which died holding it" in done.stdout, f"{fault}: no lock takeover\n{log}"
        changed = {k for k, v in published.items() if _published(run).get(k) != v}
        assert not changed, f"{fault}: published artifacts were written again: {sorted(changed)}"
        if fault is None:
            assert done.returncode == 0, log
            break
        assert done.returncode == -9, f"{fault}: expected SIGKILL at the fault point, got {done.returncode}\n{log}"
        if extra:  # --save-every 2: nothing of the trainer was written before the kill
            assert not (run / "iter-0000" / "trainer").exists() and not (run / "checkpoints").exists()
        killed_pid = pid
    assert _staging(run) == []
    final = _final_state(artifacts)
    assert final["iteration"] == baseline["iteration"] == 2
    _assert_same(_drop_timings(final), _drop_timings(baseline))

