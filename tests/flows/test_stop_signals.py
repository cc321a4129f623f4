"""A scheduler's SIGTERM or a Ctrl-C while a stage runs (``K3RL_FAULT=<stage>:sigterm|sigint``: the
process signals itself once at the stage's publish, and goes on as a real signal lets it): the run
ends promptly with exit 143 / 130 and the one line that names the resume, its embedded server gone
and its flow runs marked Crashed; the same command resumes and ends equal to the uninterrupted run.
The same command, helpers and comparison as ``test_kill_matrix.py`` (a file of its own, so that the
test session's workers share the chains out). docs/reliability.md, "SIGTERM and SIGINT at a stage"."""

from __future__ import annotations

import time

import pytest

# prepare, a stage of the loop, the train step (the live trainer in this process), and the trainer-state
# save that runs behind the next rollout on a thread of its own (the signal reaches the main thread while
# that thread writes)
STOPPED = [("rollout-iter1", "sigterm", 143), ("score_rewards-iter1", "sigint", 130), ("warmup", "sigterm", 143),
           ("train_step-iter1", "sigint", 130), ("save_checkpoint-iter0", "sigterm", 143)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, prefect_server, kill_matrix):
    km, base = kill_matrix, tmp_path_factory.mktemp("baseline")
    done, _ = km._k3rl(base / "artifacts", base / "prefect-home", None, prefect_server.api)
    assert done.returncode == 0, done.stdout[-3000:]
    return km._final_state(base / "artifacts")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage, point, status", STOPPED, ids=[f"{s}:{p}" for s, p, _ in STOPPED])
def test_a_stop_signal_at_a_stage_ends_the_run_resumably(stage, point, status, baseline, tmp_path, kill_matrix):
    km, run_id = kill_matrix, kill_matrix.RUN_ID
    artifacts, run, home = tmp_path / "artifacts", tmp_path / "artifacts" / "runs" / run_id, tmp_path / "prefect-home"
    t0 = time.monotonic()
    stopped, _ = km._k3rl(artifacts, home, f"{stage}:{point}")
    log = stopped.stdout[-4000:]
    assert stopped.returncode == status, f"expected exit {status}, got {stopped.returncode}\n{log}"
    assert time.monotonic() - t0 < 120, log
    name = point.upper()
    assert f"k3rl: stopped by {name}; run '{run_id}' is resumable: run the same command again" in stopped.stdout, log
    assert "Traceback" not in stopped.stdout, log
    km._no_server_left(home)
    states = km._flow_runs(home)
    assert "RUNNING" not in {s for _, s in states.values()} and "CRASHED" in {s for _, s in states.values()}, states

    resumed, _ = km._k3rl(artifacts, home, None)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert km._staging(run) == []
    km._assert_same(km._drop_timings(km._final_state(artifacts)), km._drop_timings(baseline))
