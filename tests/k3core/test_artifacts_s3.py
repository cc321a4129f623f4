"""The artifact store on s3:// against a real S3 server (moto's, on 127.0.0.1, through s3fs): atomic
and idempotent publication, reading from another machine's cache, transient errors retried by the
client, and permanent ones that fail naming the object with nothing half-published.
Faults are the server's answers (``tests/s3_local.py``), not patches of k3rl's code."""

import shutil
import uuid

import pytest

from k3core.artifacts import COMPLETE, ArtifactRootError, ArtifactStore, sha256_tree
from k3core.storage import StorageAccessDenied


@pytest.fixture
def s3(local_s3, monkeypatch, tmp_path):
    """(server, bucket name): a fresh bucket, this process pointed at the server and nowhere else."""
    local_s3.configure(monkeypatch, tmp_path)
    monkeypatch.setenv("K3RL_CACHE_DIR", str(tmp_path / "cache-a"))
    bucket = f"k3rl-{uuid.uuid4().hex[:12]}"
    local_s3.filesystem().mkdir(bucket)
    yield local_s3, bucket
    local_s3.clear_faults()


def objects(server, prefix: str) -> list[str]:
    fs = server.filesystem()
    return sorted(p[len(prefix) + 1:] for p in fs.find(prefix)) if fs.exists(prefix) else []


def build_state(tmp, files=("a.bin", "b.bin", "c.bin", "d.bin")):
    (tmp / "state").mkdir()
    for i, name in enumerate(files):
        (tmp / "state" / name).write_bytes(bytes([i]) * (1000 + i))


def test_publish_is_atomic_idempotent_and_read_back_on_another_machine(s3, monkeypatch, tmp_path):
    server, bucket = s3
    store = ArtifactStore(f"s3://{bucket}/k3rl")
    with store.publish("runs/r/trainer", is_dir=True) as tmp:
        build_state(tmp)
        assert not store.exists("runs/r/trainer")  # nothing visible before the build finishes
    with store.publish("runs/r/scored.parquet") as tmp:
        tmp.write_bytes(b"table")
    store.replace_text("runs/r/latest.json", '{"iteration": 1}')
    store.replace_text("runs/r/latest.json", '{"iteration": 2}')
    assert objects(server, f"{bucket}/k3rl") == ["runs/r/latest.json", "runs/r/scored.parquet",
                                                 f"runs/r/trainer/{COMPLETE}", "runs/r/trainer/state/a.bin",
                                                 "runs/r/trainer/state/b.bin", "runs/r/trainer/state/c.bin",
                                                 "runs/r/trainer/state/d.bin"]  # no temporary key left
    handle = store.handle("runs/r/trainer", "dcp", version=1, inner="state")
    # a second publish of the same artifact is a no-op
    with store.publish("runs/r/scored.parquet") as tmp:
        tmp.write_bytes(b"other")
    assert store.read_text("runs/r/latest.json") == '{"iteration": 2}'

    # another machine (an empty cache; machine A's is gone): the remote is the truth, downloaded on use
    shutil.rmtree(store.cache)
    monkeypatch.setenv("K3RL_CACHE_DIR", str(tmp_path / "cache-b"))
    other = ArtifactStore(f"s3://{bucket}/k3rl")
    assert other.cache != store.cache
    assert other.open_local("runs/r/scored.parquet").read_bytes() == b"table"
    moved = other.localize(handle)  # the handle names machine A's cache; B gets its own copy
    assert moved.path == str(other.cache / "runs/r/trainer/state") and moved.uri == handle.uri
    assert sha256_tree(moved.path) == handle.sha256
    assert other.localize(moved) is moved  # present: nothing to do


def test_transient_errors_are_retried_and_the_publish_completes(s3):
    server, bucket = s3
    store = ArtifactStore(f"s3://{bucket}/k3rl")
    slow = server.fail("PUT", f"/{bucket}/k3rl/runs/r/.tmp-scored.parquet-*", status=503, code="SlowDown", times=2)
    internal = server.fail("PUT", f"/{bucket}/k3rl/runs/r/trainer/state/b.bin", status=500, code="InternalError",
                           times=2)
    with store.publish("runs/r/scored.parquet") as tmp:
        tmp.write_bytes(b"table")
    with store.publish("runs/r/trainer", is_dir=True) as tmp:
        build_state(tmp)
    assert slow.hits == 2 and internal.hits == 2  # the faults happened, and were retried through
    assert server.filesystem().cat_file(f"{bucket}/k3rl/runs/r/scored.parquet") == b"table"
    assert server.filesystem().cat_file(f"{bucket}/k3rl/runs/r/trainer/state/b.bin") == b"\x01" * 1001
    assert store.exists("runs/r/trainer")


def test_access_denied_mid_directory_leaves_nothing_half_published(s3, tmp_path):
    server, bucket = s3
    store = ArtifactStore(f"s3://{bucket}/k3rl")
    prefix = f"{bucket}/k3rl/runs/r/trainer"
    denied = server.fail("PUT", f"/{prefix}/state/c.bin", status=403, code="AccessDenied")
    with pytest.raises(StorageAccessDenied, match=rf"cannot write s3://{prefix}/state/c.bin: access denied"):
        with store.publish("runs/r/trainer", is_dir=True) as tmp:
            build_state(tmp)
    assert denied.hits >= 1
    assert objects(server, prefix) == []  # a.bin and b.bin were uploaded, then removed
    assert not store.exists("runs/r/trainer")
    assert not [p for p in (store.cache / "runs/r").iterdir()]  # no local copy, no staging left

    # the storage refuses the cleanup too: what stays has no marker, so no reader takes it
    server.fail("POST", f"/{bucket}", status=403, code="AccessDenied")  # DeleteObjects
    server.fail("DELETE", f"/{prefix}/*", status=403, code="AccessDenied")
    with pytest.raises(StorageAccessDenied):
        with store.publish("runs/r/trainer", is_dir=True) as tmp:
            build_state(tmp)
    assert objects(server, prefix) == ["state/a.bin", "state/b.bin"]
    assert not store.exists("runs/r/trainer")
    with pytest.raises(FileNotFoundError, match="never completely published"):
        store.open_local("runs/r/trainer")

    # once the storage allows it, the next publish removes the leftovers first: exactly the new files
    server.clear_faults()
    with store.publish("runs/r/trainer", is_dir=True) as tmp:
        build_state(tmp, files=("a.bin", "z.bin"))
    assert objects(server, prefix) == [COMPLETE, "state/a.bin", "state/z.bin"]


def test_check_access_names_a_missing_bucket_and_denied_writes(s3):
    server, bucket = s3
    with pytest.raises(ArtifactRootError, match="s3://no-such-bucket-k3rl/k3rl is not usable: .*the bucket does not "
                                                "exist.*create it, or fix the URL"):
        ArtifactStore("s3://no-such-bucket-k3rl/k3rl").check_access()
    server.fail("PUT", f"/{bucket}/read-only/*", status=403, code="AccessDenied")
    with pytest.raises(ArtifactRootError, match=f"s3://{bucket}/read-only is not usable: cannot write .*access denied"):
        ArtifactStore(f"s3://{bucket}/read-only").check_access()
    ArtifactStore(f"s3://{bucket}/k3rl").check_access()
    assert objects(server, bucket) == []  # the probe is removed
