"""fetch: file:// and memory:// sources, resume after an interrupted transfer, pins checked before
any shard moves, destinations it must not replace, and failures that leave the destination as it
was. Reference: the source files' bytes and sha256."""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest

from k3core.checkpoint import fetch as fetch_mod
from k3core.checkpoint.fetch import RECORD_NAME, FetchError, FetchRefused, fetch, resolve_filesystem
from k3core.checkpoint.files import sha256_file
from k3core.checkpoint.hf import init_checkpoint
from k3core.checkpoint.manifest import write_manifest
from k3core.checkpoint.pin import PinMismatchError, make_pin


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src") / "ck"
    init_checkpoint("tiny", d, seed=3, max_shard_bytes=60_000)
    (d / "README.md").write_text("tiny test checkpoint\n")
    return d


def tree(d: Path) -> dict[str, str]:
    """Every file and its sha256, fetch's own record left out."""
    return {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != RECORD_NAME}


def staging(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.fetching"


class Interrupt(BaseException):
    """Stands for Ctrl-C (a BaseException) in the middle of a transfer."""


def interrupt_after(monkeypatch, nbytes: int) -> None:
    real = fetch_mod._Progress.add

    def add(self, n=0, file_done=False):
        real(self, n, file_done)
        if self.done >= nbytes:
            raise Interrupt()
    monkeypatch.setattr(fetch_mod._Progress, "add", add)


def shards_of(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("model-*.safetensors"))


@pytest.fixture
def memory_copy(source):
    """The source checkpoint in fsspec's in-memory filesystem; yields its URL."""
    fs = fsspec.filesystem("memory")
    root = f"/ck-{uuid.uuid4().hex[:8]}"
    for p in source.iterdir():
        fs.pipe(f"{root}/{p.name}", p.read_bytes())
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def test_fetch_file_url_then_nothing_to_do(source, tmp_path):
    res = fetch(source.as_uri(), tmp_path / "d", workers=3)
    assert tree(tmp_path / "d") == tree(source)
    assert sorted(res.downloaded) == sorted(tree(source)) and not res.skipped
    again = fetch(str(source), tmp_path / "d")  # a plain path works too; everything is in place
    assert again.bytes_downloaded == 0 and sorted(again.skipped) == sorted(tree(source))
    assert [p.name for p in (tmp_path / "d").iterdir() if p.name.startswith(".")] == [RECORD_NAME]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging, no lock left


def test_fetch_memory_url_resumes_an_interrupted_fetch(source, memory_copy, tmp_path, monkeypatch, capsys):
    dest = tmp_path / "d"
    total = sum(p.stat().st_size for p in source.iterdir())
    with monkeypatch.context() as m:
        interrupt_after(m, total // 2)
        with pytest.raises(Interrupt):
            fetch(memory_copy, dest, progress=True, chunk_bytes=4096, workers=1)
    assert not dest.exists()  # nothing published by a fetch that did not finish
    kept = sum(p.stat().st_size for p in staging(dest).iterdir() if p.name != RECORD_NAME)
    assert 0 < kept < total
    res = fetch(memory_copy, dest, progress=True, chunk_bytes=4096)
    assert tree(dest) == tree(source)
    assert res.bytes_downloaded == total - kept  # only what was missing
    assert not staging(dest).exists()
    assert "fetch [" in capsys.readouterr().err


def test_pin_refuses_config_or_index_before_any_shard(source, tmp_path):
    pin = make_pin(source).to_dict()
    bad = dict(pin, index_sha256=hashlib.sha256(b"another index").hexdigest())
    with pytest.raises(PinMismatchError, match="model.safetensors.index.json"):
        fetch(source.as_uri(), tmp_path / "d", pin=bad)
    assert shards_of(tmp_path / "d") == [] and not list((tmp_path / "d").glob(".*.part"))
    bad = dict(pin, config_sha256=hashlib.sha256(b"x").hexdigest())
    with pytest.raises(PinMismatchError, match="config.json"):
        fetch(source.as_uri(), tmp_path / "e", pin=bad)
    assert shards_of(tmp_path / "e") == []
    # a pin file on disk, all right: everything arrives
    (tmp_path / "pin.json").write_text(json.dumps(pin))
    fetch(source.as_uri(), tmp_path / "f", pin=tmp_path / "pin.json")
    assert tree(tmp_path / "f") == tree(source)


def test_pinned_shard_hash_mismatch_is_never_published(source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    pin = make_pin(src)
    victim = shards_of(src)[-1]
    b = bytearray((src / victim).read_bytes())
    b[-1] ^= 0x01  # a flipped bit in the data
    (src / victim).write_bytes(bytes(b))
    with pytest.raises(PinMismatchError, match=victim):
        fetch(src.as_uri(), tmp_path / "d", pin=pin)
    assert not (tmp_path / "d" / victim).exists() and not (tmp_path / "d" / f".{victim}.part").exists()


def test_stale_partial_is_discarded_when_the_hash_disagrees(source, tmp_path):
    dest = tmp_path / "d"
    staging(dest).mkdir()
    victim = shards_of(source)[0]
    (staging(dest) / f".{victim}.part").write_bytes(b"\0" * 1000)  # a prefix from some other file
    # ... recorded as a fetch of this URL with this file's identity: only the hash can tell
    remote = fetch_mod.list_remote(*resolve_filesystem(source.as_uri()))
    (staging(dest) / RECORD_NAME).write_text(json.dumps(
        {"source": source.as_uri(), "files": {n: {"identity": rf.identity} for n, rf in remote.items()}}))
    res = fetch(source.as_uri(), dest, pin=make_pin(source))
    assert tree(dest) == tree(source) and victim in res.downloaded


def test_a_part_from_another_source_is_never_resumed(source, tmp_path):
    """Same file name, another checkpoint: without a pin the hash of the whole file is known only
    from the source's manifest, so the staging record's URL is what keeps the splice out."""
    other = tmp_path / "other"
    init_checkpoint("tiny", other, seed=4, max_shard_bytes=60_000)  # same names and sizes, other bytes
    dest = tmp_path / "d"
    victim = shards_of(source)[0]
    assert (other / victim).stat().st_size == (source / victim).stat().st_size
    fetch(other.as_uri(), tmp_path / "warm")  # learn the record format from a real fetch of `other`
    staging(dest).mkdir()
    (staging(dest) / f".{victim}.part").write_bytes((other / victim).read_bytes()[:5000])
    rec = json.loads((tmp_path / "warm" / RECORD_NAME).read_text())
    (staging(dest) / RECORD_NAME).write_text(json.dumps(rec))
    (source / "k3rl.manifest.json").rename(tmp_path / "m.json")  # no expected hash at all
    try:
        res = fetch(source.as_uri(), dest)
        assert tree(dest) == tree(source)
        assert res.bytes_downloaded == sum(p.stat().st_size for p in source.iterdir())  # nothing resumed
    finally:
        (tmp_path / "m.json").rename(source / "k3rl.manifest.json")


def test_destination_holding_another_checkpoint_is_refused_and_untouched(source, tmp_path):
    dest = tmp_path / "d"
    init_checkpoint("tiny", dest, seed=9, max_shard_bytes=60_000)  # same sizes as source, other weights
    before = tree(dest)
    with pytest.raises(FetchError, match="not empty and is not a fetch k3rl made"):
        fetch(source.as_uri(), dest)
    assert tree(dest) == before
    other = tmp_path / "other"
    init_checkpoint("tiny", other, seed=9, max_shard_bytes=60_000)
    fetch(other.as_uri(), tmp_path / "e")
    with pytest.raises(FetchError, match=f"is a fetch of {other.as_uri()}"):
        fetch(source.as_uri(), tmp_path / "e")
    assert tree(tmp_path / "e") == tree(other)


def test_refetch_replaces_a_changed_file_and_reuses_the_rest(source, tmp_path):
    src = Path(shutil.copytree(source, tmp_path / "src"))
    dest = tmp_path / "d"
    fetch(src.as_uri(), dest)
    victim = shards_of(src)[0]
    b = bytearray((dest / victim).read_bytes())
    b[-1] ^= 0x01  # the local copy rots; same size, same remote identity
    (dest / victim).write_bytes(bytes(b))
    res = fetch(src.as_uri(), dest)
    assert tree(dest) == tree(src) and res.downloaded == [victim]


def test_failed_fetch_leaves_the_previous_fetch_whole(source, tmp_path):
    src = Path(shutil.copytree(source, tmp_path / "src"))
    dest = tmp_path / "d"
    fetch(src.as_uri(), dest)
    before = tree(dest)
    gone = shards_of(src)[1]
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg, indent=1))  # a new version of the source's config
    write_manifest(src)
    (src / gone).unlink()  # which lost a shard its index still names
    with pytest.raises(FetchError, match=gone):
        fetch(src.as_uri(), dest)
    assert tree(dest) == before  # config and index of the good checkpoint were not overwritten


def test_own_source_and_overlaps_are_refused(source, tmp_path):
    src = Path(shutil.copytree(source, tmp_path / "src"))
    before = tree(src)
    for dest in (src, src / "sub", tmp_path):
        with pytest.raises(FetchError, match="overlaps"):
            fetch(src.as_uri(), dest)
        with pytest.raises(FetchError, match="overlaps"):
            fetch(str(src), dest)
    assert tree(src) == before


def test_a_source_that_is_not_a_checkpoint_is_refused_before_copying(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text("x" * 1000)
    (src / "model.safetensors").write_bytes(b"\0" * 1000)
    with pytest.raises(FetchError, match="not a checkpoint in the public layout: no config.json"):
        fetch(src.as_uri(), tmp_path / "d")
    assert not (tmp_path / "d").exists() and not staging(tmp_path / "d").exists()
    with pytest.raises(FetchError, match="no files found"):
        fetch((tmp_path / "nowhere").as_uri(), tmp_path / "d")


def test_a_corrupt_transfer_is_caught_by_the_source_manifest(source, tmp_path):
    """No pin: the source's own k3rl manifest gives the expected hash of every file."""
    src = Path(shutil.copytree(source, tmp_path / "src"))
    victim = shards_of(src)[-1]
    b = bytearray((src / victim).read_bytes())
    b[-1] ^= 0x01
    (src / victim).write_bytes(bytes(b))
    with pytest.raises(PinMismatchError, match=victim):
        fetch(src.as_uri(), tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_index_naming_a_shard_the_remote_lacks_fails_before_transfers(source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    gone = shards_of(src)[0]
    (src / gone).unlink()
    with pytest.raises(FetchError, match=gone):
        fetch(src.as_uri(), tmp_path / "d")
    assert shards_of(tmp_path / "d") == []


def test_missing_protocol_backend_is_a_clear_error():
    try:  # s3fs comes with the test extra (tests/k3core/checkpoint/test_fetch_s3.py); gcsfs does not
        import gcsfs  # noqa: F401
        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="gcsfs"):
        resolve_filesystem("gs://bucket/ck")


def test_refusals_are_bad_input_and_not_retried(source, tmp_path):
    """The stages retry transient errors only, never a ValueError (tasks.common.NON_RETRYABLE): a
    refused destination or source is one, a failed transfer is not."""
    with pytest.raises(FetchRefused) as e:
        fetch((tmp_path / "nowhere").as_uri(), tmp_path / "d")
    assert isinstance(e.value, ValueError) and isinstance(e.value, FetchError)
    assert not issubclass(FetchError, ValueError)
