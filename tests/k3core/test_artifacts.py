"""Atomic publication in the artifact store, local and through fsspec (memory://)."""

import os
import uuid

import pytest

from k3core.artifacts import COMPLETE, ArtifactStore


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_publish_is_atomic_and_idempotent(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("K3RL_CACHE_DIR", str(tmp_path / "cache"))
    root = str(tmp_path / "root") if kind == "local" else f"memory://k3rl-test-{uuid.uuid4().hex[:8]}"
    store = ArtifactStore(root)
    with store.publish("runs/r/ck", is_dir=True) as tmp:
        (tmp / "a.bin").write_bytes(b"abc")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("x")
        assert not store.exists("runs/r/ck")  # nothing visible before the build finishes
    assert store.exists("runs/r/ck")
    local = store.open_local("runs/r/ck")
    assert (local / "a.bin").read_bytes() == b"abc" and (local / "sub" / "b.txt").read_text() == "x"
    # a second publish of the same artifact is a no-op: the first result stays
    with store.publish("runs/r/ck", is_dir=True) as tmp:
        (tmp / "a.bin").write_bytes(b"other")
    assert (store.open_local("runs/r/ck") / "a.bin").read_bytes() == b"abc"
    assert store.uri("runs/r/ck").startswith("file:///" if kind == "local" else "memory://")


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_failed_build_publishes_nothing(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("K3RL_CACHE_DIR", str(tmp_path / "cache"))
    root = str(tmp_path / "root") if kind == "local" else f"memory://k3rl-test-{uuid.uuid4().hex[:8]}"
    store = ArtifactStore(root)
    store.write_text("runs/r/report.json", "{}")
    with pytest.raises(RuntimeError):
        with store.publish("runs/r/scored.parquet") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash mid-write")
    assert not store.exists("runs/r/scored.parquet")
    assert store.read_text("runs/r/report.json") == "{}"
    with pytest.raises(FileNotFoundError, match="never completely published"):
        store.open_local("runs/r/scored.parquet")


def test_directory_without_marker_is_not_trusted(tmp_path):
    store = ArtifactStore(tmp_path)
    (tmp_path / "runs" / "half").mkdir(parents=True)
    (tmp_path / "runs" / "half" / "x").write_text("partial")
    assert not store.exists("runs/half")
    with store.publish("runs/half", is_dir=True) as tmp:
        (tmp / "x").write_text("full")
    assert (tmp_path / "runs" / "half" / COMPLETE).exists()
    assert (tmp_path / "runs" / "half" / "x").read_text() == "full"


def test_staging_of_a_dead_writer_is_removed_and_a_live_writers_is_kept(tmp_path):
    """A killed writer leaves its staging path; the sweep removes exactly those whose pid is gone on
    this host, never a live writer's (it may run beside one) nor another host's."""
    import subprocess
    import sys

    from k3core.artifacts import staging_writer

    store = ArtifactStore(str(tmp_path))
    script = ("import os, signal, sys; from k3core.artifacts import ArtifactStore\n"
              f"s = ArtifactStore({str(tmp_path)!r})\n"
              "with s.publish('runs/r/iter-0000/t', is_dir=True) as tmp:\n"
              "    (tmp / 'half').write_bytes(b'x')\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", script]).returncode == -9
    with store.publish("runs/r/live.txt") as live:  # this process: alive while the sweep runs
        live.write_text("y")
        dead = [p for p in (tmp_path / "runs" / "r" / "iter-0000").iterdir()]
        assert len(dead) == 1 and staging_writer(dead[0].name)[1] != os.getpid()
        host, pid = staging_writer(dead[0].name)
        foreign = dead[0].with_name(f".tmp-t.{'0' * 8 if host != '0' * 8 else '1' * 8}.{pid}.abcdef12")
        foreign.mkdir()
        assert store.remove_dead_staging("runs/r") == dead
        assert live.exists() and foreign.exists() and not dead[0].exists()
    assert store.read_text("runs/r/live.txt") == "y"
    assert not store.exists("runs/r/iter-0000/t")


# --------------------------------------------------------------------------- published digests

def test_published_sha256_is_hashlib_s_and_reads_a_file_once_per_identity(tmp_path, monkeypatch):
    """Against hashlib over the bytes (the independent reference), for files hashed in parallel; a
    hard link of a hashed file and a second call cost no read; a file rewritten (new mtime or size)
    is read again, so a changed file never keeps an old digest."""
    import hashlib
    import time

    from k3core import artifacts

    blobs = {f"f{i}": os.urandom(1000 * i + 7) for i in range(6)}
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    reads = []
    real = artifacts.sha256_file
    monkeypatch.setattr(artifacts, "sha256_file", lambda p: reads.append(str(p)) or real(p))
    paths = [tmp_path / n for n in blobs]
    assert artifacts.published_sha256(paths, workers=3) == [hashlib.sha256(d).hexdigest() for d in blobs.values()]
    assert len(reads) == 6
    os.link(tmp_path / "f3", tmp_path / "link")
    assert artifacts.published_sha256([tmp_path / "link", tmp_path / "f0"]) == [
        hashlib.sha256(blobs["f3"]).hexdigest(), hashlib.sha256(blobs["f0"]).hexdigest()]
    assert len(reads) == 6  # a stat each
    time.sleep(0.01)
    (tmp_path / "f0").write_bytes(b"changed")
    assert artifacts.published_sha256([tmp_path / "f0"]) == [hashlib.sha256(b"changed").hexdigest()]
    assert reads[-1] == str(tmp_path / "f0") and len(reads) == 7


def test_sha256_tree_names_each_file_with_its_digest(tmp_path):
    import hashlib

    from k3core.artifacts import sha256_tree

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"bee")
    (tmp_path / "a").write_bytes(b"ay")
    (tmp_path / COMPLETE).write_bytes(b"")  # the publish marker is not content
    want = hashlib.sha256()
    for rel, data in (("a", b"ay"), ("d/b", b"bee")):
        want.update(rel.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
    assert sha256_tree(tmp_path) == want.hexdigest()


def test_a_link_out_of_the_root_carries_no_write_and_no_delete(tmp_path):
    """A symlink planted under the root (runs/r/checkpoints -> a directory elsewhere): retention's
    delete and a publish through it are refused and leave the other directory as it was; a link that
    stays inside the root is followed as before."""
    from k3core.artifacts import ArtifactPathError

    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "iter-0001").mkdir(parents=True)
    (elsewhere / "iter-0001" / COMPLETE).write_text("")
    root = tmp_path / "root"
    (root / "runs" / "r").mkdir(parents=True)
    (root / "runs" / "r" / "checkpoints").symlink_to(elsewhere)
    store = ArtifactStore(root)
    with pytest.raises(ArtifactPathError, match="outside the artifact root .* symbolic link"):
        store.remove("runs/r/checkpoints/iter-0001")
    with pytest.raises(ArtifactPathError):
        with store.publish("runs/r/checkpoints/iter-0002", is_dir=True) as tmp:
            (tmp / "x").write_text("x")
    with pytest.raises(ArtifactPathError):
        store.replace_text("runs/r/checkpoints/latest.json", "{}")
    assert sorted(p.name for p in elsewhere.rglob("*")) == [COMPLETE, "iter-0001"]
    (root / "kept").mkdir()
    (root / "runs" / "r" / "tables").symlink_to(root / "kept")
    store.write_text("runs/r/tables/a.txt", "a")
    assert (root / "kept" / "a.txt").read_text() == "a" and store.remove("runs/r/tables/a.txt")


def test_a_run_whose_directory_holds_a_link_out_of_the_root_is_refused_before_any_work(tmp_path, capsys):
    from flows.cli import main

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root" / "runs" / "r").mkdir(parents=True)
    (tmp_path / "root" / "runs" / "r" / "checkpoints").symlink_to(tmp_path / "elsewhere")
    rc = main(["run", "--preset", "tiny", "--run-id", "r", "--artifacts", str(tmp_path / "root"), "--iterations", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "checkpoints is a symbolic link to" in err and "outside the artifact root" in err, err
    assert "Traceback" not in err and not list((tmp_path / "elsewhere").iterdir())
