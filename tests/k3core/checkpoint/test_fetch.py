"""fetch: file:// and memory:// sources, resume after an interrupted transfer, pins checked before
any shard moves. Reference: the source files' bytes and sha256."""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest

from k3core.checkpoint.fetch import FetchError, fetch, resolve_filesystem
from k3core.checkpoint.files import sha256_file
from k3core.checkpoint.hf import init_checkpoint
from k3core.checkpoint.pin import PinMismatchError, make_pin


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src") / "ck"
    init_checkpoint("tiny", d, seed=3, max_shard_bytes=60_000)
    (d / "README.md").write_text("tiny test checkpoint\n")
    return d


def tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


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
    assert not [p for p in (tmp_path / "d").iterdir() if p.name.startswith(".")]


def test_fetch_memory_url_resumes_a_partial_transfer(source, memory_copy, tmp_path, capsys):
    dest = tmp_path / "d"
    dest.mkdir()
    shards = shards_of(source)
    full = (source / shards[1]).read_bytes()
    (dest / f".{shards[1]}.part").write_bytes(full[: len(full) // 3])  # interrupted transfer
    (dest / shards[2]).write_bytes((source / shards[2]).read_bytes()[:100])  # a truncated file in place
    (dest / shards[0]).write_bytes((source / shards[0]).read_bytes())  # complete already
    res = fetch(memory_copy, dest, progress=True, chunk_bytes=4096)
    assert tree(dest) == tree(source)
    assert shards[0] in res.skipped and shards[1] in res.downloaded and shards[2] in res.downloaded
    total = sum(p.stat().st_size for p in source.iterdir())
    assert res.bytes_downloaded == total - len(full) // 3 - (source / shards[0]).stat().st_size  # only what was missing
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
    dest.mkdir()
    victim = shards_of(source)[0]
    (dest / f".{victim}.part").write_bytes(b"\0" * 1000)  # a prefix from some other file
    res = fetch(source.as_uri(), dest, pin=make_pin(source))
    assert tree(dest) == tree(source) and victim in res.downloaded


def test_index_naming_a_shard_the_remote_lacks_fails_before_transfers(source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    gone = shards_of(src)[0]
    (src / gone).unlink()
    with pytest.raises(FetchError, match=gone):
        fetch(src.as_uri(), tmp_path / "d")
    assert shards_of(tmp_path / "d") == []


def test_missing_protocol_backend_is_a_clear_error():
    try:
        import s3fs  # noqa: F401
        pytest.skip("s3fs is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="s3fs"):
        resolve_filesystem("s3://bucket/ck")
