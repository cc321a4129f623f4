"""Disk as a resource, end to end: the preflight refuses a run its artifact root cannot hold (the
message names the free space, the need and the flags that fit), counts only what a resumed run still
writes, leaves remote roots alone; a write that hits a full disk mid-run (``K3RL_FAULT=<stage>:enospc``,
``k3core/faults.py``) ends ``k3rl run`` with one error line, exit status 1, no traceback and no staging
path, and the same command, once space is back, resumes and ends as an uninterrupted run does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3core.rl import disk
from k3core.settings import RLSettings

ROOT = Path(__file__).resolve().parents[2]


def _settings(root: Path, **flat) -> RLSettings:
    return RLSettings.from_dict({"preset": "tiny", "run_id": "r", "artifacts": str(root), "iterations": 30,
                                 "env": "reverse", **flat})


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("k3rl: error:")]


def test_the_preflight_refuses_a_root_without_room(tmp_path, monkeypatch):
    from flows.preflight import _prompt_tokens, check_settings
    from k3core.rl.envs import load_env

    s = _settings(tmp_path, keep_checkpoints=0)
    need = disk.run_disk_need(s, prompt_tokens=_prompt_tokens(load_env("reverse"), 0)[0])
    free = need.total - 20 * need.state_bytes  # room for ten states of the thirty
    monkeypatch.setattr(disk, "free_bytes", lambda path: free)
    with pytest.raises(ValueError) as e:
        check_settings(s)
    message = str(e.value)
    assert message.startswith(f"--artifacts {tmp_path}: {disk.gb(free)} free on "), message
    assert re.search(r"the run needs \d+\.\d [MG]B at its peak \(30 trainer states of ", message), message
    assert f"the run needs {disk.gb(need.total)}" in message
    assert "--keep-checkpoints 9 (needs " in message and "--save-every 3 (needs " in message, message
    assert message.endswith(f"another --artifacts with at least {disk.gb(need.total)} free"), message
    assert not (tmp_path / "runs").exists()  # nothing written
    monkeypatch.setattr(disk, "free_bytes", lambda path: 10**12)
    check_settings(s)


def test_a_resumed_run_counts_only_what_remains(tmp_path, monkeypatch):
    """Prepared weights and published iterations are on disk already (and so out of the free
    space): a resume that has only its last state and tables left fits where a new run does not."""
    import json

    from flows.preflight import _prompt_tokens, check_settings
    from k3core.artifacts import COMPLETE
    from k3core.rl.envs import load_env

    s = _settings(tmp_path, iterations=3, keep_checkpoints=1)
    tokens = _prompt_tokens(load_env("reverse"), 0)[0]
    fresh = disk.run_disk_need(s, prompt_tokens=tokens)
    left = disk.run_disk_need(s, disk.RunProgress(frozenset({"source", "warmup", "rollout-weights-v0"}), 2, 2, 1),
                              prompt_tokens=tokens)
    assert (left.states, left.prepared) == (1, 0) and fresh.total > left.total + (1 << 20)
    monkeypatch.setattr(disk, "free_bytes", lambda path: left.total + (1 << 20))
    with pytest.raises(ValueError, match="the run needs"):
        check_settings(s)
    run = tmp_path / "runs" / "r"
    for d in ("source", "warmup", "rollout-weights-v0", "iter-0001/trainer"):
        (run / d).mkdir(parents=True)
        (run / d / COMPLETE).write_text("")
    for i in (0, 1):
        (run / f"iter-{i:04d}").mkdir(exist_ok=True)
        (run / f"iter-{i:04d}" / "scored.parquet").write_bytes(b"x")
    (run / "latest.json").write_text(json.dumps({"version": 2}))
    check_settings(s)  # one more state, beside the kept one, and one iteration's tables


def test_a_remote_root_is_not_measured(monkeypatch):
    from flows.preflight import check_disk

    monkeypatch.setattr(disk, "free_bytes", lambda path: 0)
    check_disk(RLSettings.from_dict({"preset": "tiny", "run_id": "r", "artifacts": "memory://k3rl-disk"}))


def _unshare_mount_works(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    (tmp_path / "probe").mkdir()
    p = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path / 'probe'}"],
                       capture_output=True, timeout=30)
    return p.returncode == 0


def test_a_run_on_a_small_tmpfs_is_refused_before_any_stage(tmp_path):
    """A real 48 MiB tmpfs (mounted in a user and mount namespace of its own): ``k3rl run`` exits 2
    with one error naming the free space, the need and the flags, and writes nothing."""
    if not _unshare_mount_works(tmp_path):
        pytest.skip("no user/mount namespaces here (unshare -rm) to mount a tmpfs in")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(tmp_path / "prefect-home"))
    cmd = (f"mount -t tmpfs -o size=48m tmpfs {mnt} && {sys.executable} -m flows.cli run --preset tiny --iterations 10 "
           f"--keep-checkpoints 0 --run-id small-disk --artifacts {mnt}/artifacts; echo rc=$?; ls -A {mnt}")
    p = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert "rc=2" in p.stdout, p.stdout + p.stderr
    assert p.stdout.strip().endswith("rc=2"), p.stdout  # the tmpfs is empty: nothing was created
    [error] = _errors(p.stderr)
    assert f"--artifacts {mnt}/artifacts: " in error and " free on " in error and "the run needs" in error, error
    assert "--keep-checkpoints " in error and "another --artifacts" in error, error
    assert "Traceback" not in p.stderr and "embedded server is up" not in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_full_disk_mid_run_fails_clean_and_the_same_command_resumes_equal(tmp_path, prefect_server, kill_matrix,
                                                                          kill_matrix_baseline):
    """Iteration 0's trainer state, written beside iteration 1's rollout, hits ENOSPC halfway through
    its write (a fault point, as a full disk would), and the run, which joins that write after
    iteration 1, fails with it: one ``k3rl: error:`` line naming the disk, exit 1, no traceback,
    no retry, no ``.tmp-*`` left, no trainer state published. The same command, unarmed, resumes and
    ends with the final trainer state, tables and metrics of an uninterrupted run."""
    km, expected = kill_matrix, kill_matrix_baseline

    root, home = tmp_path / "artifacts", tmp_path / "prefect-home"
    failed, _ = km._k3rl(root, home, "save_checkpoint-iter0:enospc", prefect_server.api)
    out = failed.stdout
    assert failed.returncode == 1, out[-3000:]
    [error] = _errors(out)
    assert "run 'kill' stopped: the disk is full: No space left on device writing " in error, error
    assert re.search(r"\(\d+\.\d [MG]B free now on /", error) and "run the same command to resume" in error, error
    assert "Traceback" not in out and "Retrying" not in out, out[-3000:]
    run = root / "runs" / km.RUN_ID
    assert km._staging(run) == [] and not [p for p in root.rglob(".tmp-*")]
    assert (run / "iter-0000" / "rollouts.parquet").is_file() and not (run / "iter-0000" / "trainer").exists()

    resumed, _ = km._k3rl(root, home, None, prefect_server.api)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    got = km._final_state(root)
    km._assert_same(km._drop_timings(got), km._drop_timings(expected))
    assert km._staging(run) == []
