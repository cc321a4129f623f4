"""``K3RL_FAULT`` (k3core/faults.py): the spec is parsed strictly, a point kills only inside the stage it
names, ``mid-write`` leaves a half-written staging path without touching a hard-linked original, and
with the variable unset stages run unwrapped. The end-to-end use is tests/flows/test_kill_matrix.py."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from k3core import faults

ROOT = Path(__file__).resolve().parents[2]


def test_spec_is_parsed_strictly():
    assert faults.parse(None) is None and faults.parse("") is None
    assert faults.parse("rollout-iter1:mid-write") == ("rollout-iter1", "mid-write")
    assert faults.parse("a:b:after-publish") == ("a:b", "after-publish")
    for bad in ("rollout", "rollout:mid", ":mid-write", "rollout-iter1:"):
        with pytest.raises(ValueError, match="before-publish, mid-write, after-publish"):
            faults.parse(bad)


def _run(fault: str, body: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, K3RL_FAULT=fault, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_point_kills_only_inside_the_stage_it_names(tmp_path):
    body = f"""
        from pathlib import Path
        from k3core import faults
        staging = Path({str(tmp_path)!r}) / ".tmp-x"
        faults.reached("mid-write", staging)          # no stage running: nothing happens
        with faults.in_stage("score_rewards-iter1", "score"):
            faults.reached("mid-write", staging)      # another stage
            faults.reached("after-publish")           # another point
        print("alive", flush=True)
        with faults.in_stage("rollout-iter1", "rollout"):
            faults.reached("mid-write", staging)
        print("survived")
    """
    (tmp_path / ".tmp-x").write_bytes(b"0123456789")
    for spec in ("rollout-iter1:mid-write", "rollout:mid-write"):  # the task run name, or the stage's key
        (tmp_path / ".tmp-x").write_bytes(b"0123456789")
        done = _run(spec, body)
        assert done.returncode == -9 and done.stdout == "alive\n", (spec, done.stdout, done.stderr)
        assert (tmp_path / ".tmp-x").read_bytes() == b"01234"


def test_mid_write_cuts_a_copy_and_never_a_hard_linked_original(tmp_path):
    published = tmp_path / "published.bin"
    published.write_bytes(b"a" * 1000)
    staging = tmp_path / ".tmp-dir"
    staging.mkdir()
    os.link(published, staging / "weights.bin")  # save_checkpoint links the trainer state's files
    (staging / "small.json").write_text("{}")
    done = _run("save:mid-write", f"""
        from pathlib import Path
        from k3core import faults
        with faults.in_stage("save_checkpoint-iter0", "save"):
            faults.reached("mid-write", Path({str(staging)!r}))
    """)
    assert done.returncode == -9, done.stderr
    assert (staging / "weights.bin").read_bytes() == b"a" * 500
    assert published.read_bytes() == b"a" * 1000 and (staging / "small.json").read_text() == "{}"


def test_a_bad_spec_fails_at_import_naming_the_points():
    done = _run("rollout:halfway", "import k3core.faults")
    assert done.returncode == 1 and "K3RL_FAULT='rollout:halfway'" in done.stderr and "mid-write" in done.stderr


def test_unset_the_stage_body_is_the_tasks_function(tmp_path, monkeypatch):
    from k3core.artifacts import Artifact
    from tasks.common import Run
    from tasks.score import score_rewards

    run = Run(str(tmp_path), "r")
    rollouts = Artifact(kind="rollouts", uri=run.uri(run.iter_rel(0, "rollouts.parquet")), path="", sha256="")
    monkeypatch.setattr(faults, "SPEC", None)
    args = (run, 0, rollouts, 2)
    # the task's body is the stage function under one layer (the lineage stamp, tasks.common._stamped)
    assert score_rewards.task(*args)[0].fn.__wrapped__ is score_rewards.fn
    monkeypatch.setattr(faults, "SPEC", ("score_rewards-iter0", "after-publish"))
    wrapped = score_rewards.task(*args)[0].fn
    assert wrapped.__wrapped__ is not score_rewards.fn and wrapped.__wrapped__.__wrapped__ is score_rewards.fn
