"""Fetch a checkpoint from any fsspec URL into a local directory: parallel, resumable, pinned.

Owns: listing the remote files, transferring them with a bounded buffer (several at once, one
progress bar on stderr), resuming partial transfers, skipping files already in place, publishing
each file atomically, and refusing what a pin does not allow.

URLs: ``file://`` (or a plain path), ``memory://``, ``s3://`` (needs ``s3fs``), ``hf://org/name@revision``
(needs ``huggingface_hub``; its ``HfFileSystem``), or any other protocol fsspec knows.

Order, so that a wrong checkpoint costs two small files and not a terabyte: ``config.json`` and
``model.safetensors.index.json`` first; checked against the pin (``PinMismatchError``) and the index
checked against the remote listing; only then the shards and the rest, in parallel.

Destination: ``dest`` is replaced only by a complete, checked fetch, in one step. Everything is
fetched into a staging directory beside it (``.<dest>.fetching``) and swapped in at the end
(``files.publish_dir``), so a fetch that fails, whatever the cause, leaves ``dest`` as it was.
``dest`` must be absent, empty, or an earlier fetch of the same URL (the ``.k3rl-fetch.json``
record inside it says which); any other directory is refused before a byte moves, and so is a
destination that is the source or lies inside it (or holds it). A source without ``config.json``
and ``model.safetensors.index.json`` is not a checkpoint and is refused before any copy.

Storage errors (access denied, no credentials, a missing bucket, an endpoint that does not answer
after the client's own retries) leave as ``k3core.storage.StorageError`` naming the remote file and
the fix; transient ones (S3's 503 SlowDown, a dropped connection) are retried by botocore and s3fs
first. Either way ``dest`` is untouched, and the staged files and parts are kept for the next run.

Expected hashes: the pin's, the LFS sha256 ``HfFileSystem`` reports, and the source's own
``k3rl.manifest.json`` (fetched with config and index) when it has one; every transferred file is
checked against the one known, and a checkpoint with a manifest keeps it, so later loads check it.

Resume: a transfer writes ``.<name>.part`` in the staging directory and keeps it when interrupted;
the next run of the same URL continues from its length (re-reading the prefix once to hash it). The
staging directory records the URL and each remote file's identity (size, and the ETag, LFS hash,
modification time or creation time the listing gives); a part, or a staged file, whose URL or
identity differs is discarded, never resumed. A file already in an earlier fetch of the same URL
is reused (hard link) when its identity is unchanged and its bytes still have the sha256 recorded
when it was fetched (and the known hash). A completed transfer whose hash disagrees with a known
hash is discarded and fetched once more from zero, then refused.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from k3core.checkpoint.files import (CONFIG_NAME, HASH_CHUNK, INDEX_NAME, atomic_write_json, fsync_dir, publish_dir,
                                     sha256_file)
from k3core.checkpoint.manifest import MANIFEST_NAME
from k3core.checkpoint.pin import Pin, PinMismatchError, load_pin
from k3core.storage import storage_call

__all__ = ["fetch", "FetchResult", "FetchError", "FetchRefused", "resolve_filesystem", "list_remote", "RECORD_NAME"]

RECORD_NAME = ".k3rl-fetch.json"  # in a fetched checkpoint and in its staging directory: URL, identities, sha256
_LOCAL_PROTOCOLS = ("file", "local")

_EXTRA_FOR = {"s3": ("s3fs", "pip install s3fs"), "s3a": ("s3fs", "pip install s3fs"),
              "hf": ("huggingface_hub", "pip install huggingface_hub"),
              "gs": ("gcsfs", "pip install gcsfs"), "gcs": ("gcsfs", "pip install gcsfs")}


class FetchError(RuntimeError):
    """A transfer that cannot complete (missing remote file, hash mismatch after retry, ...)."""


class FetchRefused(FetchError, ValueError):
    """Bad input, refused before anything is copied (a destination fetch must not replace, a source
    that is missing or not a checkpoint): retrying cannot help, so it is also a ``ValueError``."""


@dataclass
class RemoteFile:
    name: str  # relative to the checkpoint root, '/'-separated
    path: str  # the filesystem's own path
    size: int
    sha256: str | None = None  # when the remote knows it (HF LFS)
    identity: dict = field(default_factory=dict)  # size and what the listing says changes with the content


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
        size = int(info.get("size") or 0)
        sha = _lfs_sha256(info)
        out[name] = RemoteFile(name, path, size, sha, _identity(info, size, sha))
    return out


def _identity(info: dict, size: int, sha: str | None) -> dict:
    """What tells one version of a remote file from another without reading it: its size and the
    first of LFS sha256, ETag, blob id, modification time, creation time the listing gives."""
    ident = {"size": size}
    for key, value in (("sha256", sha), ("etag", info.get("ETag") or info.get("etag")),
                       ("blob_id", info.get("blob_id")), ("mtime", info.get("mtime") or info.get("LastModified")),
                       ("created", info.get("created"))):
        if value is not None:
            ident[key] = value if isinstance(value, (int, float, str)) else str(value)
            break
    return ident


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


def _transfer(fs, rf: RemoteFile, dest: Path, want: str | None, progress: _Progress, chunk: int) -> tuple[int, str]:
    """Copy one remote file to ``dest/rf.name`` through ``.name.part`` (resumed when present); verify
    size and, when known, sha256; publish atomically. Returns (bytes transferred, sha256 of the file)."""
    final = dest / rf.name
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(f".{final.name}.part")
    uri = fs.unstrip_protocol(rf.path)
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
        with storage_call("read", uri):
            src = fs.open(rf.path, "rb")
        with open(part, "ab") as out, src:
            if have:
                src.seek(have)
            while have + moved < rf.size:
                with storage_call("read", uri):  # the source's errors only, not the local disk's
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
        return moved, digest
    raise AssertionError("unreachable")


def _local_root(fs, root: str) -> Path | None:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return Path(root).resolve() if protocol in _LOCAL_PROTOCOLS else None


def _source_key(fs, root: str) -> str:
    """One spelling per source (``/x``, ``file:///x`` and ``./x`` from ``/`` are the same)."""
    local = _local_root(fs, root)
    if local is not None:
        return local.as_uri()
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://{root}"


def _check_destination(url: str, fs, root: str, dest: Path) -> dict | None:
    """Refuse a destination that is the source (or inside it, or holding it), or a non-empty
    directory that is not an earlier fetch of ``url``. Returns that earlier fetch's record."""
    src = _local_root(fs, root)
    d = dest.resolve()
    if src is not None and (d == src or src in d.parents or d in src.parents):
        raise FetchRefused(f"destination {dest} is the source {url} or overlaps it: fetch into another directory")
    if dest.exists() and not dest.is_dir():
        raise FetchRefused(f"destination {dest} exists and is not a directory")
    if not dest.is_dir() or not any(dest.iterdir()):
        return None
    record = _read_record(dest)
    if record is None or record.get("source") != url:
        was = f"a fetch of {record.get('source')}" if record else "not a fetch k3rl made"
        raise FetchRefused(f"destination {dest} is not empty and is {was}: refusing to replace it with {url}; "
                         f"fetch into an empty or new directory, or remove {dest} first")
    return record


def _read_record(d: Path) -> dict | None:
    try:
        rec = json.loads((d / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(rec, dict) and isinstance(rec.get("source"), str) and isinstance(rec.get("files"), dict)
    return rec if ok else None


def _prepare_staging(staging: Path, url: str, remote: dict[str, RemoteFile]) -> None:
    """Keep what an interrupted fetch of the same URL left in ``staging`` (parts and finished files
    whose remote identity is unchanged); discard everything else."""
    record = _read_record(staging) if staging.is_dir() else None
    if staging.exists() and (record is None or record.get("source") != url):
        shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    old = record["files"] if record and record.get("source") == url else {}
    for p in sorted(staging.rglob("*"), reverse=True):
        if p.is_dir() or p.name == RECORD_NAME:
            continue
        rel = p.relative_to(staging).as_posix()
        name = rel
        if p.name.startswith(".") and p.name.endswith(".part"):
            name = str(Path(rel).with_name(p.name[1:-len(".part")]).as_posix())
        rf = remote.get(name)
        if rf is None or old.get(name, {}).get("identity") != rf.identity:
            p.unlink()
    atomic_write_json(staging / RECORD_NAME, {"source": url, "files": {n: {"identity": rf.identity}
                                                                        for n, rf in remote.items()}})


def _lock(staging_parent: Path, dest: Path):
    import fcntl

    f = open(staging_parent / f".{dest.name}.fetch-lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise FetchError(f"another fetch into {dest} is running (lock {f.name}); wait for it") from None
    return f


def fetch(url: str, dest: str | os.PathLike, pin: str | os.PathLike | dict | Pin | None = None, *,
          workers: int = 8, include: list[str] | None = None, progress: bool | None = None,
          chunk_bytes: int = HASH_CHUNK) -> FetchResult:
    """Copy the checkpoint at ``url`` into ``dest``; see the module docstring.

    ``include``: fnmatch patterns selecting the other files (README, tokenizer, ...); config, index,
    manifest and every shard the index names are always fetched.
    ``progress``: draw the stderr bar (default: when stderr is a terminal).
    Raises ``FetchError`` for a destination it must not replace or a source that is not a
    checkpoint, ``PinMismatchError`` before any shard transfer if config or index differ from
    the pin, and ``k3core.storage.StorageError`` (``.permanent``: access denied, no credentials)
    when the source cannot be listed or read. ``dest`` is untouched unless the whole fetch succeeds.
    """
    t0 = time.monotonic()
    url = str(url)
    pin_obj = pin if isinstance(pin, Pin) or pin is None else load_pin(pin)
    fs, root = resolve_filesystem(url)
    dest = Path(dest).absolute()
    try:
        with storage_call("list", url):
            remote = list_remote(fs, root)
    except FileNotFoundError as e:  # the source, or its bucket, does not exist: bad input
        raise FetchRefused(f"{url}: not found ({e.__cause__ or e}); check the URL") from None
    if not remote:
        raise FetchRefused(f"{url}: no files found (check the URL: it must name a checkpoint directory)")
    missing_heads = [n for n in (CONFIG_NAME, INDEX_NAME) if n not in remote]
    if missing_heads:
        raise FetchRefused(f"{url} is not a checkpoint in the public layout: no {' and no '.join(missing_heads)} "
                         f"(give the directory that holds config.json, the index and the shards)")
    source = _source_key(fs, root)
    previous = _check_destination(source, fs, root, dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock(dest.parent, dest)
    staging = dest.parent / f".{dest.name}.fetching"
    result = FetchResult(dest)
    try:
        _prepare_staging(staging, source, remote)
        _fetch_into(fs, url, source, remote, staging, dest, previous, pin_obj, include, progress, workers, chunk_bytes, result)
        publish_dir(staging, dest)
        (dest.parent / f".{dest.name}.fetch-lock").unlink(missing_ok=True)
    finally:
        lock.close()
    result.seconds = time.monotonic() - t0
    return result


def _fetch_into(fs, url, source, remote, staging: Path, dest: Path, previous: dict | None, pin_obj: Pin | None,
                include, progress, workers: int, chunk_bytes: int, result: FetchResult) -> None:
    manifest_hashes: dict[str, str] = {}

    def want(rf: RemoteFile) -> str | None:
        return (pin_obj.expected(rf.name) if pin_obj else None) or rf.sha256 or manifest_hashes.get(rf.name)

    fetched: dict[str, str] = {}  # name -> sha256 of the bytes now in staging

    def place(rf: RemoteFile) -> bool:
        """Already staged by an interrupted run, or reusable from the earlier fetch in ``dest``."""
        w = want(rf)
        staged = staging / rf.name
        if staged.is_file() and staged.stat().st_size == rf.size:
            h = sha256_file(staged)
            if w is None or h == w:
                fetched[rf.name] = h
                return True
            staged.unlink()
        old = (previous or {}).get("files", {}).get(rf.name)
        have = dest / rf.name
        if old and old.get("identity") == rf.identity and have.is_file() and have.stat().st_size == rf.size:
            h = sha256_file(have)
            if h == old.get("sha256") and (w is None or h == w):
                staged.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(have, staged)
                except OSError:
                    shutil.copy2(have, staged)
                fetched[rf.name] = h
                return True
        return False

    heads = [n for n in (CONFIG_NAME, INDEX_NAME, MANIFEST_NAME) if n in remote]
    rest = [n for n in sorted(remote) if n not in heads
            and (include is None or any(fnmatch.fnmatch(n, p) for p in include))]
    bar = _Progress(sum(remote[n].size for n in heads + rest), len(heads) + len(rest),
                    sys.stderr.isatty() if progress is None else progress)
    try:
        # 1. config + index (+ manifest), checked against the pin before anything large moves
        for name in heads:
            rf = remote[name]
            if place(rf):
                result.skipped.append(name)
                bar.add(rf.size, file_done=True)
                continue
            moved, fetched[name] = _transfer(fs, rf, staging, want(rf), bar, chunk_bytes)
            result.bytes_downloaded += moved
            result.downloaded.append(name)
        if pin_obj is not None:
            for name in (CONFIG_NAME, INDEX_NAME):
                pin_obj.check(name, fetched[name])
        if MANIFEST_NAME in heads:
            manifest_hashes.update(_manifest_hashes(url, staging))
            for name in heads:
                if name in manifest_hashes and manifest_hashes[name] != fetched[name]:
                    raise PinMismatchError(f"{url}: {name} does not match the source's own {MANIFEST_NAME}: "
                                           f"the source changed while it was read, or is corrupt")
        with open(staging / INDEX_NAME) as f:
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
            if place(rf):
                result.skipped.append(name)
                bar.add(rf.size, file_done=True)
            else:
                todo.append(rf)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = {rf.name: pool.submit(_transfer, fs, rf, staging, want(rf), bar, chunk_bytes) for rf in todo}
            errors = []
            for name, fut in futures.items():
                try:
                    moved, fetched[name] = fut.result()
                    result.bytes_downloaded += moved
                    result.downloaded.append(name)
                except BaseException as e:  # let the others finish publishing, then report the first
                    errors.append(e)
            if errors:
                raise errors[0]
    finally:
        bar.close()
    atomic_write_json(staging / RECORD_NAME, {"source": source, "files": {
        n: {"identity": remote[n].identity, "sha256": h} for n, h in sorted(fetched.items())}})


def _manifest_hashes(url: str, staging: Path) -> dict[str, str]:
    from k3core.checkpoint.manifest import ManifestError, read_manifest

    try:
        return {n: e["sha256"] for n, e in read_manifest(staging)["files"].items()}
    except ManifestError as e:
        raise FetchError(f"{url}: its {MANIFEST_NAME} cannot be used: {e}") from None
