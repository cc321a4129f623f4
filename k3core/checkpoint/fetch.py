"""Fetch a checkpoint from any fsspec URL into a local directory: parallel, resumable, pinned.

Owns: listing the remote files, transferring them with a bounded buffer (several at once, one
progress bar on stderr), resuming partial transfers, skipping files already in place, publishing
each file atomically, and refusing what a pin does not allow.

URLs: ``file://`` (or a plain path), ``memory://``, ``s3://`` (needs ``s3fs``), ``hf://org/name@revision``
(needs ``huggingface_hub``; its ``HfFileSystem``), or any other protocol fsspec knows.

Order, so that a wrong checkpoint costs two small files and not a terabyte: ``config.json`` and
``model.safetensors.index.json`` first; checked against the pin (``PinMismatchError``) and the index
checked against the remote listing; only then the shards and the rest, in parallel.

Resume: a transfer writes ``.<name>.part`` beside its final name and keeps it when interrupted; the
next run continues from its length (re-reading the prefix once to hash it). A file already at its
final name with the right size, and the right sha256 where one is known (pin, or the LFS hash
``HfFileSystem`` reports), is skipped. A completed transfer whose hash disagrees with a known hash is
discarded and fetched once more from zero, then refused.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from k3core.checkpoint.files import CONFIG_NAME, HASH_CHUNK, INDEX_NAME, fsync_dir, sha256_file
from k3core.checkpoint.pin import Pin, PinMismatchError, load_pin

__all__ = ["fetch", "FetchResult", "FetchError", "resolve_filesystem", "list_remote"]

_EXTRA_FOR = {"s3": ("s3fs", "pip install s3fs"), "s3a": ("s3fs", "pip install s3fs"),
              "hf": ("huggingface_hub", "pip install huggingface_hub"),
              "gs": ("gcsfs", "pip install gcsfs"), "gcs": ("gcsfs", "pip install gcsfs")}


class FetchError(RuntimeError):
    """A transfer that cannot complete (missing remote file, hash mismatch after retry, ...)."""


@dataclass
class RemoteFile:
    name: str  # relative to the checkpoint root, '/'-separated
    path: str  # the filesystem's own path
    size: int
    sha256: str | None = None  # when the remote knows it (HF LFS)


@dataclass
class FetchResult:
    dest: Path
    downloaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_downloaded: int = 0
    seconds: float = 0.0


def resolve_filesystem(url: str):
    """(fsspec filesystem, root path) for a URL, with a clear error when its backend is missing."""
    import fsspec

    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in _EXTRA_FOR:
        module, how = _EXTRA_FOR[protocol]
        try:
            __import__(module)
        except ImportError:
            raise ImportError(f"{url}: the {protocol}:// protocol needs the '{module}' package ({how})") from None
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise ImportError(f"{url}: no fsspec filesystem for protocol {protocol!r} ({e})") from e
    return fs, root.rstrip("/")


def _lfs_sha256(info: dict) -> str | None:
    """The sha256 HfFileSystem reports for LFS files (a dict or a BlobLfsInfo, by version)."""
    lfs = info.get("lfs")
    sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    return sha if isinstance(sha, str) and len(sha) == 64 else None


def list_remote(fs, root: str) -> dict[str, RemoteFile]:
    """Every file under ``root`` by relative name (hidden files and directories skipped)."""
    found = fs.find(root, detail=True)
    prefix = root + "/"
    out = {}
    for path, info in found.items():
        if info.get("type", "file") != "file":
            continue
        p = path.rstrip("/")
        if p.startswith(prefix):
            name = p[len(prefix):]
        elif p.lstrip("/").startswith(prefix.lstrip("/")):
            name = p.lstrip("/")[len(prefix.lstrip("/")):]
        else:
            raise FetchError(f"remote listing returned {path!r}, outside {root!r}")
        if any(part.startswith(".") for part in name.split("/")):
            continue
        out[name] = RemoteFile(name, path, int(info.get("size") or 0), _lfs_sha256(info))
    return out


class _Progress:
    """One stderr line: bytes done / total, rate, files done. Thread-safe, redrawn at most 5x/s."""

    def __init__(self, total: int, nfiles: int, enabled: bool):
        self.total, self.nfiles, self.enabled = total, nfiles, enabled
        self.done = self.files = 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, n: int = 0, file_done: bool = False) -> None:
        with self.lock:
            self.done += n
            self.files += file_done
            now = time.monotonic()
            if self.enabled and (file_done or now - self.last > 0.2):
                self.last = now
                frac = self.done / self.total if self.total else 1.0
                bar = "#" * int(30 * frac)
                rate = self.done / max(now - self.t0, 1e-9) / 2**20
                sys.stderr.write(f"\rfetch [{bar:<30}] {self.done / 2**30:7.2f}/{self.total / 2**30:.2f} GiB "
                                 f"{rate:7.1f} MiB/s  files {self.files}/{self.nfiles}")
                sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _local_ok(local: Path, rf: RemoteFile, want: str | None) -> bool:
    if not local.is_file() or local.stat().st_size != rf.size:
        return False
    return want is None or sha256_file(local) == want


def _transfer(fs, rf: RemoteFile, dest: Path, want: str | None, progress: _Progress, chunk: int) -> int:
    """Copy one remote file to ``dest/rf.name`` through ``.name.part`` (resumed when present); verify
    size and, when known, sha256; publish atomically. Returns bytes transferred."""
    final = dest / rf.name
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(f".{final.name}.part")
    for attempt in (0, 1):
        h = hashlib.sha256()
        have = part.stat().st_size if part.is_file() else 0
        if have > rf.size:
            part.unlink()
            have = 0
        if have:
            with open(part, "rb") as f:  # hash the prefix we keep
                while b := f.read(chunk):
                    h.update(b)
            progress.add(have)
        moved = 0
        with open(part, "ab") as out, fs.open(rf.path, "rb") as src:
            if have:
                src.seek(have)
            while have + moved < rf.size:
                b = src.read(min(chunk, rf.size - have - moved))
                if not b:
                    break
                out.write(b)
                h.update(b)
                moved += len(b)
                progress.add(len(b))
            out.flush()
            os.fsync(out.fileno())
        size = part.stat().st_size
        digest = h.hexdigest()
        if size != rf.size:
            raise FetchError(f"{rf.name}: the remote file ended at {size} bytes, the listing said {rf.size}")
        if want is not None and digest != want:
            part.unlink()
            progress.add(-(have + moved))
            if attempt == 0 and have:
                continue  # the kept prefix may be stale: once more from zero
            raise PinMismatchError(f"{rf.name}: sha256 {digest} of the transferred file does not match the "
                                   f"expected {want}: refusing it")
        os.replace(part, final)
        fsync_dir(final.parent)
        progress.add(file_done=True)
        return moved
    raise AssertionError("unreachable")


def fetch(url: str, dest: str | os.PathLike, pin: str | os.PathLike | dict | Pin | None = None, *,
          workers: int = 8, include: list[str] | None = None, progress: bool | None = None,
          chunk_bytes: int = HASH_CHUNK) -> FetchResult:
    """Copy the checkpoint at ``url`` into ``dest`` (created if needed); see the module docstring.

    ``include``: fnmatch patterns selecting the other files (README, tokenizer, ...); config, index
    and every shard the index names are always fetched.
    ``progress``: draw the stderr bar (default: when stderr is a terminal).
    Raises ``PinMismatchError`` before any shard transfer if config or index differ from the pin.
    """
    t0 = time.monotonic()
    pin_obj = pin if isinstance(pin, Pin) or pin is None else load_pin(pin)
    fs, root = resolve_filesystem(str(url))
    remote = list_remote(fs, root)
    if not remote:
        raise FetchError(f"{url}: no files found")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    result = FetchResult(dest.absolute())

    def want(rf: RemoteFile) -> str | None:
        return (pin_obj.expected(rf.name) if pin_obj else None) or rf.sha256

    heads = [n for n in (CONFIG_NAME, INDEX_NAME) if n in remote]
    if pin_obj is not None and len(heads) < 2:
        raise FetchError(f"{url}: a pinned fetch needs {CONFIG_NAME} and {INDEX_NAME}; the remote has {heads}")
    rest = [n for n in sorted(remote) if n not in heads
            and (include is None or any(fnmatch.fnmatch(n, p) for p in include))]
    bar = _Progress(sum(remote[n].size for n in heads + rest), len(heads) + len(rest),
                    sys.stderr.isatty() if progress is None else progress)
    try:
        # 1. config + index, checked against the pin before anything large moves
        for name in heads:
            rf = remote[name]
            if _local_ok(dest / name, rf, want(rf)):
                result.skipped.append(name)
                bar.add(rf.size, file_done=True)
                continue
            result.bytes_downloaded += _transfer(fs, rf, dest, want(rf), bar, chunk_bytes)
            result.downloaded.append(name)
        if pin_obj is not None:
            for name in heads:
                pin_obj.check(name, sha256_file(dest / name))
        if INDEX_NAME in heads:
            with open(dest / INDEX_NAME) as f:
                try:
                    shards = set(json.load(f)["weight_map"].values())
                except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                    raise FetchError(f"{url}: {INDEX_NAME} has no readable weight_map ({e})") from e
            missing = sorted(s for s in shards if s not in remote)
            if missing:
                raise FetchError(f"{url}: the index names shard {missing[0]!r} ({len(missing)} in all) that the "
                                 f"remote does not have")
            if pin_obj is not None and pin_obj.files:
                unpinned = sorted(s for s in shards if s not in pin_obj.files)
                if unpinned:
                    raise PinMismatchError(f"the pin lists per-file hashes but not {unpinned[0]!r} named by the index")
            rest = sorted(set(rest) | (shards - set(heads)))
        # 2. everything else, in parallel
        todo = []
        for name in rest:
            rf = remote[name]
            if _local_ok(dest / name, rf, want(rf)):
                result.skipped.append(name)
                bar.add(rf.size, file_done=True)
            else:
                todo.append(rf)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = {rf.name: pool.submit(_transfer, fs, rf, dest, want(rf), bar, chunk_bytes) for rf in todo}
            errors = []
            for name, fut in futures.items():
                try:
                    result.bytes_downloaded += fut.result()
                    result.downloaded.append(name)
                except BaseException as e:  # let the others finish publishing, then report the first
                    errors.append(e)
            if errors:
                raise errors[0]
    finally:
        bar.close()
    result.seconds = time.monotonic() - t0
    return result
