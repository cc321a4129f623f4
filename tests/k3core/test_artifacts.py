"""Atomic publication in the artifact store, local and through fsspec (memory://)."""

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
