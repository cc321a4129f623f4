"""A scheduler's SIGTERM or a Ctrl-C while a stage runs (``K3RL_FAULT=<stage>:sigterm|sigint``: the
process signals itself once at the stage's publish, and goes on as a real signal lets it): the run
ends promptly with exit 143 / 130 and the one line that names the resume, its embedded server gone
and its flow runs marked Crashed; the same command resumes and ends equal to the uninterrupted run.
The same command, helpers and comparison as ``test_kill_matrix.py`` (a file of its own, so that the
test session's workers share the chains out). docs/reliability.md, "SIGTERM and SIGINT at a stage".

Each stop is tested once, in chains as the kill matrix's: the same command, run again after a stop,
resumes and is stopped at the next point; a last, unarmed run finishes. Every run of a chain starts
its own embedded server in the chain's PREFECT_HOME."""

from __future__ import annotations

import time

import pytest

STATUS = {"sigterm": 143, "sigint": 130}
CHAINS = {
    # prepare, two stages of the loop, and the train step (the live trainer in this process), each
    # stopped in the process that resumed the stop before, in the order the run reaches them
    "loop": [("warmup", "sigterm"), ("rollout-iter1", "sigterm"), ("score_rewards-iter1", "sigint"),
             ("train_step-iter1", "sigint")],
    # the trainer-state save that runs behind iteration 1's rollout on a thread of its own (the signal
    # reaches the main thread while that thread writes); a chain of its own, because whether iteration
    # 1's rollout was published before the stop is up to the scheduler
    "save-behind": [("save_checkpoint-iter0", "sigterm")],
}


@pytest.fixture(scope="module")
def baseline(kill_matrix_baseline):
    return kill_matrix_baseline


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chain", list(CHAINS))
def test_a_stop_signal_at_a_stage_ends_the_run_resumably(chain, baseline, tmp_path, kill_matrix):
    km, run_id = kill_matrix, kill_matrix.RUN_ID
    artifacts, run, home = tmp_path / "artifacts", tmp_path / "artifacts" / "runs" / run_id, tmp_path / "prefect-home"
    for stage, point in CHAINS[chain]:
        before = set(km._flow_runs(home)) if (home / "prefect.db").exists() else set()
        t0 = time.monotonic()
        stopped, _ = km._k3rl(artifacts, home, f"{stage}:{point}")
        log, step = stopped.stdout[-4000:], f"{stage}:{point}"
        assert stopped.returncode == STATUS[point], f"{step}: expected exit {STATUS[point]}, got {stopped.returncode}\n{log}"
        assert time.monotonic() - t0 < 120, log
        name = point.upper()
        assert f"k3rl: stopped by {name}; run '{run_id}' is resumable: run the same command again" in stopped.stdout, log
        assert "Traceback" not in stopped.stdout, f"{step}\n{log}"
        km._no_server_left(home)
        states = km._flow_runs(home)
        assert "RUNNING" not in {s for _, s in states.values()}, f"{step}: {states}"
        assert "CRASHED" in {s for i, (_, s) in states.items() if i not in before}, f"{step}: {states}"

    resumed, _ = km._k3rl(artifacts, home, None)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert km._staging(run) == []
    km._assert_same(km._drop_timings(km._final_state(artifacts)), km._drop_timings(baseline))
