"""The console a user reads: help for every flag, a run id generated and printed with its resume
command, a progress bar only on a terminal, no Python warnings, ``--keep-checkpoints`` retention that
still resumes, and a replay of a finished run that runs nothing and rewrites no record."""

import argparse
import json
import os
import pty
import re
import select
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import _settings_from_args, build_parser, new_run_id, resume_command
from flows.console import BAR_CHARACTER, progress_wanted
from flows.retention import checkpoints_to_keep
from k3core.artifacts import ArtifactStore

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RUN_FLAGS = ["--preset", "tiny", "--prompts-per-iteration", "4", "--samples-per-prompt", "4", "--max-new-tokens", "4",
             "--warmup-steps", "2", "--warmup-batch", "8", "--eval-prompts", "8", "--keep-checkpoints", "1"]
# "UserWarning: ...", "FutureWarning: ...", "warnings.warn(" (the source line Python prints after one)
WARNING_LINE = re.compile(r"\b[A-Z]\w*Warning: |^\s*warnings\.warn\(", re.M)


def _actions(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _actions(child, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_flag_of_every_subcommand_has_help():
    seen = list(_actions(build_parser(), "k3rl"))
    assert len(seen) > 100  # the walk reached the run settings and every subcommand
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in seen
               if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()]
    assert missing == []


def test_run_without_run_id_gets_a_new_one_and_the_command_that_resumes_it():
    p = build_parser()
    ids = {_settings_from_args(p.parse_args(["run", "--preset", "tiny"])).pipeline.run_id for _ in range(3)}
    assert len(ids) == 3  # never a shared default
    for rid in ids:
        assert re.fullmatch(r"run-\d{8}-\d{6}-[0-9a-f]{4}", rid)
    assert re.fullmatch(r"run-\d{8}-\d{6}-[0-9a-f]{4}", new_run_id())
    assert _settings_from_args(p.parse_args(["run", "--run-id", "mine"])).pipeline.run_id == "mine"
    assert resume_command(["run", "--preset", "tiny"], "run-x") == "k3rl run --preset tiny --run-id run-x"
    assert resume_command(["run", "--run-id", "a b"], "a b") == "k3rl run --run-id 'a b'"
    run_help = next(a.help for path, a in _actions(p, "k3rl") if path == "k3rl run" and "--run-id" in a.option_strings)
    assert "new id" in run_help and "demo" not in run_help


def test_progress_only_on_a_terminal(tmp_path):
    with open(tmp_path / "f", "w") as f:
        assert not progress_wanted(f)
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as t:
            assert progress_wanted(t) == (os.environ.get("TERM", "") != "dumb")
    finally:
        os.close(master)
        os.close(slave)


BAR_SCRIPT = """
from flows.console import run_progress
from tasks.common import progress_event
with run_progress(True):
    progress_event("iterations", done=0, total=2)
    progress_event("stage_start", name="warmup")
    for i in range(3):
        progress_event("stage_step", name="warmup", done=i + 1, total=3)
    progress_event("stage_end", name="warmup")
    progress_event("stage_start", name="evaluate-final")
    progress_event("stage_end", name="evaluate-final")
    progress_event("iterations", done=2, total=2)
"""


def test_bar_rows_on_a_terminal(tmp_path):
    """The bar as a terminal receives it: the iterations row ends at 2/2, a stage that reports steps
    counts them, and a stage that reports none after it has no count (not the previous stage's)."""
    rc, out = _run_in_pty([sys.executable, "-c", BAR_SCRIPT], _env(tmp_path))
    assert rc == 0, out
    rows = [r.strip() for r in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)) if r.strip()]
    assert any(r.startswith("iterations") and r.split()[-2] == "2/2" for r in rows), rows
    assert any("warmup" in r and " 3/3 " in r for r in rows), rows
    final = [r for r in rows if "evaluate-final" in r]
    assert final and all(" 0/? " in r for r in final), final


def test_heartbeat_names_a_long_stage_in_a_pipe():
    """Without a terminal, a stage in flight longer than the beat gets a line per beat naming it; a
    stage shorter than the beat gets none, and no line follows the stage's end."""
    import io
    import time

    from flows.console import stage_heartbeat
    from tasks.common import progress_event

    out = io.StringIO()
    with stage_heartbeat(True, every_s=0.4, stream=out):
        progress_event("stage_start", name="rollout-iter0")
        progress_event("stage_end", name="rollout-iter0")
        progress_event("stage_start", name="train_step-iter0")
        time.sleep(1.1)
        progress_event("stage_end", name="train_step-iter0")
        time.sleep(0.6)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["k3rl: train_step-iter0 in flight for 0.4 s", "k3rl: train_step-iter0 in flight for 0.8 s"], lines
    assert len(lines) <= 3 and all("train_step-iter0" in x for x in lines), lines  # a slow tick may add the third beat


@pytest.mark.parametrize("latest,keep,staleness,kept", [
    (5, 0, 0, {1, 2, 3, 4, 5}),   # 0: keep everything
    (5, 1, 0, {5}),               # the latest is what resume reads
    (5, 2, 0, {4, 5}),
    (5, 1, 1, {4, 5}),            # one-step-off-policy: a resumed run may sample with the version before
    (1, 1, 1, {1}),
    (5, 1, 3, {2, 3, 4, 5}),      # staleness K: the K before the latest
    (2, 1, 3, {1, 2}),
    (3, 10, 0, {1, 2, 3}),
])
def test_checkpoints_to_keep(latest, keep, staleness, kept):
    assert checkpoints_to_keep(latest, keep, staleness) == kept


@pytest.mark.parametrize("root", ["local", "memory://k3rl-console-test"])
def test_remove_unpublishes_before_deleting(tmp_path, root):
    store = ArtifactStore(str(tmp_path) if root == "local" else root)
    with store.publish("runs/r/checkpoints/iter-0001", is_dir=True) as tmp:
        (tmp / "state").mkdir()
        (tmp / "state" / "x.distcp").write_bytes(b"1234")
    assert store.exists("runs/r/checkpoints/iter-0001")
    assert store.remove("runs/r/checkpoints/iter-0001") is True
    assert not store.exists("runs/r/checkpoints/iter-0001")
    assert not store.local_path("runs/r/checkpoints/iter-0001").exists()
    assert store.remove("runs/r/checkpoints/iter-0001") is False


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                DO_NOT_TRACK="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="120", TERM="xterm",
                PYTHONPATH=os.pathsep.join([str(PROJECT_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def _run_in_pty(argv: list[str], env: dict, timeout: float = 600) -> tuple[int, str]:
    """``argv`` with stdin, stdout and stderr on a pseudo-terminal, as a person's shell runs it."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=PROJECT_ROOT, close_fds=True)
    os.close(slave)
    out = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=timeout), out.decode(errors="replace")
    finally:
        os.close(master)


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under the run (but its lock) with its mtime and ctime in ns."""
    out = {}
    for p in [run_dir, *run_dir.rglob("*")]:
        if p.name != ".lock":
            st = p.stat()
            out[str(p.relative_to(run_dir))] = (st.st_mtime_ns, st.st_ctime_ns)
    return out


@pytest.mark.slow
def test_tiny_run_console_retention_replay_and_resume(tmp_path, prefect_harness):
    """One tiny run as a user runs it, three ways:
    1. no --run-id, stderr not a terminal: a new id and its resume command are printed, no progress
       bar characters and no Python warning lines; --keep-checkpoints 1 leaves exactly the latest
       checkpoint and its trainer state, every rollout and score table;
    2. the printed resume command again: the recorded summary, nothing published or rewritten;
    3. the same command with --iterations 4 on a terminal: the bar is drawn, and the run continues
       from the one checkpoint retention kept, its summary keeping the prepare stages' recorded seconds;
    and the flow itself (what a deployment runs) on the finished run: its recorded summary, nothing
    rewritten."""
    env, root = _env(tmp_path), tmp_path / "artifacts"
    cli = [sys.executable, "-m", "flows.cli"]
    first = subprocess.run([*cli, "run", *RUN_FLAGS, "--iterations", "3", "--artifacts", str(root)], env=env,
                           cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    m = re.search(r"to resume or continue it: (k3rl run .*--run-id (run-\d{8}-\d{6}-[0-9a-f]{4}))$", first.stderr, re.M)
    assert m, first.stderr[:2000]
    resume, run_id = m.group(1), m.group(2)
    assert "(a new run id)" in first.stderr
    assert "k3rl: Prefect's embedded server is up on http://127.0.0.1:" in first.stderr, first.stderr[:2000]
    assert BAR_CHARACTER not in first.stderr + first.stdout
    assert WARNING_LINE.findall(first.stderr) == [], first.stderr

    run_dir = root / "runs" / run_id
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter-0003"]
    assert sorted(p.parent.name for p in run_dir.glob("iter-*/trainer")) == ["iter-0002"]
    for i in range(3):
        assert {p.name for p in (run_dir / f"iter-{i:04d}").glob("*.parquet")} == {"rollouts.parquet", "scored.parquet"}
    assert json.loads((run_dir / "latest.json").read_text())["iteration"] == 3
    assert not list(run_dir.rglob(".tmp-*"))

    # 2. the resume command as printed: a finished run replays from its records
    before = _files(run_dir)
    records = {n: (run_dir / n).read_bytes() for n in ("summary.json", "metrics.json", "lineage.json")}
    argv = shlex.split(resume)[1:]
    replay = subprocess.run([*cli, *argv], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert "finished its 3 iterations already" in replay.stderr
    assert "embedded server is up" not in replay.stderr  # no Prefect server, no flow run, no stage
    assert _files(run_dir) == before
    assert {n: (run_dir / n).read_bytes() for n in records} == records
    summary = json.loads(records["summary.json"])
    assert f"run {run_id}: 3 iterations" in replay.stdout
    assert ", ".join(f"{k} {v}" for k, v in summary["seconds_per_stage"].items()) in replay.stdout

    # 3. continue on a terminal: the bar is drawn, the one kept checkpoint is enough to go on
    rc, out = _run_in_pty([*cli, *argv, "--iterations", "4"], env)
    assert rc == 0, out[-5000:]
    assert BAR_CHARACTER in out and "4/4" in out
    assert "continuing at iteration 3" in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["iter-0004"]
    assert sorted(p.parent.name for p in run_dir.glob("iter-*/trainer")) == ["iter-0003"]
    history = json.loads((run_dir / "metrics.json").read_text())
    assert [h["iteration"] for h in history] == [0, 1, 2, 3]
    assert history[:3] == json.loads(records["metrics.json"])
    continued = json.loads((run_dir / "summary.json").read_text())
    assert continued["iterations"] == 4

    def prepare_seconds(summary):
        return {k: v for k, v in summary["seconds_per_stage"].items() if k.startswith("prepare_")}

    assert prepare_seconds(continued) == prepare_seconds(summary) != {}

    # 4. the rl_run flow on the finished run (a deployment run does not go through the CLI)
    from flows.pipeline import rl_run

    before = _files(run_dir)
    settings = _settings_from_args(build_parser().parse_args([*argv, "--iterations", "4"]))
    assert rl_run(settings) == continued
    assert _files(run_dir) == before


def test_estimate_follows_the_work():
    """The first-line estimate adds each stage's calibrated cost: twice the iterations add the
    per-iteration cost once more, no warm-up removes its cost, and where nothing is calibrated (a GPU
    preset) there is no number, only the sentence that says so."""
    from flows.estimate import CALIBRATIONS, estimate, estimate_line
    from k3core.settings import RLSettings

    base = RLSettings.from_dict({"iterations": 10, "eval_every": 0})
    double = RLSettings.from_dict({"iterations": 20, "eval_every": 0})
    cold = RLSettings.from_dict({"iterations": 10, "eval_every": 0, "warmup_steps": 0})
    e1, e2, e0 = (estimate(x, cores=2) for x in (base, double, cold))
    cal = CALIBRATIONS["small"]
    per_iteration = (cal.iteration + 128 * (cal.rollout_token * 7 + cal.score_sample) + 128 * cal.train_sample
                     + cal.mismatch_sequence * 16 / base.evaluation.mismatch_every)
    assert abs((e2 - e1) - 10 * per_iteration) < 1e-6
    assert abs((e1 - e0) - 25 * 32 * cal.warmup_sequence) < 1e-6
    assert estimate(RLSettings.from_dict({"preset": "medium"}), cores=2) is None
    assert "no time estimate" in estimate_line(RLSettings.from_dict({"preset": "medium"}))
