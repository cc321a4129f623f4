"""``k3rl run`` with its artifact root on s3://, against a real S3 server (moto's, on 127.0.0.1,
through s3fs), as a user runs it: separate processes, the endpoint and credentials from the
standard environment variables, the source checkpoint fetched from the same bucket.

One run meets server errors while it publishes: transient ones (503 SlowDown) are retried through;
a permanent one (access denied on one file of the second checkpoint) stops it with exit 2 and one
message naming the object, nothing of that checkpoint left in the bucket and ``latest.json`` still
at the first. The same command on another machine (an empty local cache and Prefect database) after
the fix resumes it: the finished iteration is not replayed, its checkpoint is downloaded to continue
from, and the unfinished iteration's published rollouts, scores and trainer state are read back, not
redone. A root whose
bucket does not exist is refused before Prefect starts. Faults are the server's answers
(``tests/s3_local.py``), not patches of k3rl's code."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flows.cli import main
from k3core.checkpoint.hf import init_checkpoint

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--preset", "tiny", "--env", "reverse", "--run-id", "s3run", "--prompts-per-iteration", "4",
         "--samples-per-prompt", "4", "--max-new-tokens", "4", "--warmup-steps", "0", "--eval-prompts", "4",
         "--eval-every", "0", "--mismatch-sequences", "0"]


def k3rl(server, machine: Path, *args: str) -> subprocess.CompletedProcess:
    """``k3rl ARGS`` in a fresh process on "machine" (its own k3rl cache and Prefect home)."""
    env = {**os.environ, **server.env(machine), "K3RL_CACHE_DIR": str(machine / "k3rl-cache"),
           "PREFECT_HOME": str(machine / "prefect"), "PYTHONPATH": str(REPO)}
    env.pop("AWS_PROFILE", None)
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=600)


def keys(server, prefix: str) -> list[str]:
    fs = server.filesystem()
    fs.invalidate_cache()
    return sorted(p[len(prefix) + 1:] for p in fs.find(prefix))


@pytest.mark.slow
def test_run_on_s3_survives_faults_and_resumes_on_another_machine(local_s3, tmp_path, monkeypatch, capsys):
    server = local_s3
    bucket = f"k3rl-{uuid.uuid4().hex[:12]}"
    server.filesystem().mkdir(bucket)
    root = f"s3://{bucket}/k3rl"
    run_prefix = f"{bucket}/k3rl/runs/s3run"
    # the source checkpoint is in the bucket too: the run's fetch stage reads it through s3fs
    init_checkpoint("tiny", tmp_path / "src", seed=3)
    for f in (tmp_path / "src").iterdir():
        server.filesystem().put_file(str(f), f"{bucket}/ckpts/tiny/{f.name}")
    run_args = [*SMALL, "--source", f"s3://{bucket}/ckpts/tiny"]

    # a bucket that does not exist: refused before any work, Prefect never started
    p = k3rl(server, tmp_path / "a", "run", *SMALL, "--iterations", "1", "--artifacts", "s3://no-such-bucket-k3rl/k3rl")
    assert p.returncode == 2, p.stderr
    assert "artifact root s3://no-such-bucket-k3rl/k3rl is not usable" in p.stderr and "bucket does not exist" in p.stderr
    assert "embedded server is up" not in p.stderr + p.stdout

    # machine a, two iterations: transient errors while publishing iteration 0's scores, then access
    # denied on one file of the checkpoint after iteration 1
    slow = server.fail("PUT", f"/{run_prefix}/iter-0000/.tmp-scored.parquet-*", status=503, code="SlowDown", times=2)
    denied = server.fail("PUT", f"/{run_prefix}/checkpoints/iter-0002/state/extra.json", status=403,
                         code="AccessDenied")
    p = k3rl(server, tmp_path / "a", "run", *run_args, "--iterations", "2", "--artifacts", root)
    assert p.returncode == 2, p.stderr[-3000:]
    assert slow.hits == 2 and denied.hits >= 1
    message = [line for line in p.stderr.splitlines() if line.startswith("k3rl: error:")]
    assert len(message) == 1, p.stderr[-3000:]
    assert (f"run 's3run' stopped: cannot write {root}/runs/s3run/checkpoints/iter-0002/state/extra.json: access "
            f"denied") in message[0] and "run the same command to resume" in message[0]
    published = keys(server, run_prefix)
    assert {"source/ckpt/config.json", "iter-0000/scored.parquet", "checkpoints/iter-0001/_COMPLETE",
            "iter-0001/scored.parquet", "iter-0001/trainer/_COMPLETE"} <= set(published)
    assert not [k for k in published if k.startswith("checkpoints/iter-0002")]  # nothing half-published
    assert not [k for k in published if "/.tmp-" in k or k.startswith(".tmp-")]
    assert json.loads(server.filesystem().cat_file(f"{run_prefix}/latest.json"))["iteration"] == 1

    # the bucket policy is fixed; the same command on machine b, which has no cache and no Prefect database
    server.clear_faults()
    shutil.rmtree(tmp_path / "a")
    n0 = len(server.requests)
    p = k3rl(server, tmp_path / "b", "run", *run_args, "--iterations", "2", "--artifacts", root)
    assert p.returncode == 0, p.stderr[-3000:]
    requests = server.requests[n0:]
    written = {path for m, path in requests if m == "PUT"}
    read = {path for m, path in requests if m == "GET"}
    redone = [w for w in written if "/iter-0000/" in w or "/iter-0001/" in w]
    assert not redone  # published rollouts, scores, trainer states and checkpoint 1: read back, not redone
    assert f"/{run_prefix}/checkpoints/iter-0001/state/extra.json" in read  # iteration 1 continues from it
    assert f"/{run_prefix}/iter-0001/trainer/state/extra.json" in read  # the trainer state published on machine a
    assert f"/{run_prefix}/checkpoints/iter-0002/state/extra.json" in written
    fs = server.filesystem()
    assert json.loads(fs.cat_file(f"{run_prefix}/latest.json"))["iteration"] == 2
    assert len(json.loads(fs.cat_file(f"{run_prefix}/metrics.json"))) == 2

    # status reads the run from the bucket; the final checkpoint validates against its manifest
    server.configure(monkeypatch, tmp_path)
    monkeypatch.setenv("K3RL_CACHE_DIR", str(tmp_path / "b" / "k3rl-cache"))
    capsys.readouterr()
    assert main(["status", "--run-id", "s3run", "--artifacts", root, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["iterations_done"] == 2 and status["latest_checkpoint"] == f"{root}/runs/s3run/checkpoints/iter-0002"
    from k3core.artifacts import ArtifactStore

    local = ArtifactStore(root).open_local("runs/s3run/checkpoints/iter-0002")
    assert main(["checkpoint", "validate", str(local / "state")]) == 0
