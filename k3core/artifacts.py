"""Artifact store: atomic publication of files and directories under one root, local or fsspec.

Every artifact is built at a temporary local name, fsync'ed, then published in one step:
``os.replace`` for a local file, ``os.rename`` of the whole directory for a local directory. For
remote roots (``s3://``, ``memory://``, any fsspec URL) a file is uploaded to a hidden temporary key
beside its final one and moved into place (on S3 a server-side copy, which, like every S3 write, is
all or nothing), and a directory's files are uploaded under its final prefix, then a ``_COMPLETE``
marker last. A reader trusts a directory only once it has its marker; a publish that fails removes
what it uploaded, and one that finds objects of an earlier, unfinished publish under the prefix
removes them before uploading. So a crash or a storage error at any point leaves either the previous
state or the new, complete artifact, never a half-written one where a good one is expected.
Publishing an artifact that already exists is a no-op (idempotent stages).

A remote root keeps a local cache of what this machine published or read (``K3RL_CACHE_DIR``,
default ``~/.cache/k3rl``, one folder per root); the remote is the truth, and an artifact handle
whose local path is gone (another machine, a wiped cache) is downloaded again (``localize``).
Storage failures leave as ``k3core.storage.StorageError`` naming the object and the fix.

A process killed mid-publish (kill -9, OOM, power) leaves its local staging path behind. Staging
names carry the writer's host and pid (``.tmp-<name>.<host>.<pid>.<nonce>``), so
``remove_dead_staging`` deletes exactly the leftovers of writers of this host that are gone, never a
live writer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any
from collections.abc import Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from k3core.checkpoint.files import sha256_file

from k3core import faults
from k3core.storage import StorageError, storage_call

COMPLETE = "_COMPLETE"
STAGING_PREFIXES = (".tmp-", ".dl-")
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def staging_name(prefix: str, name: str) -> str:
    """A fresh local staging name for ``name``, owned by this process of this host."""
    return f"{prefix}{name}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def staging_writer(name: str) -> tuple[str, int] | None:
    """(host tag, pid) of the process that made staging path ``name``; None when it is not one."""
    if not name.startswith(STAGING_PREFIXES):
        return None
    parts = name.rsplit(".", 3)
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


# digests of published files by identity (device, inode, size, mtime): published artifacts are never
# changed in place, so a hard link of one (the checkpoint commit links the trainer state's files) or a
# second handle of it costs a stat, not a read of its bytes
_published_digests: dict[tuple[int, int, int, int], str] = {}
_digests_lock = threading.Lock()
HASH_WORKERS = min(8, os.cpu_count() or 1)


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def published_sha256(paths: list[str | os.PathLike], workers: int = HASH_WORKERS) -> list[str]:
    """sha256 of each of ``paths`` (files of published artifacts), ``workers`` files at a time
    (hashlib releases the GIL while it hashes a buffer: a 22 GB trainer state hashes at the disk's
    or the cores' speed, not one core's), each file's bytes read at most once per process: a digest
    is kept by the file's identity (``_identity``). Not for integrity checks, which must read the
    bytes every time (``k3core.checkpoint.manifest.verify_manifest``)."""
    paths = [Path(p) for p in paths]
    ids = [_identity(p) for p in paths]
    with _digests_lock:
        known = [_published_digests.get(i) for i in ids]
    todo = [k for k, d in enumerate(known) if d is None]
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
            for k, digest in zip(todo, pool.map(lambda k: sha256_file(paths[k]), todo)):
                known[k] = digest
        with _digests_lock:
            _published_digests.update((ids[k], known[k]) for k in todo)
    return known


def remember_digests(root: str | os.PathLike, digests: dict[str, str]) -> None:
    """Record the sha256 of files under ``root`` (relative name -> hex) that their writer computed
    from the bytes it wrote (``k3core.checkpoint.odirect``), so ``published_sha256`` of those files
    costs a stat. Only for files that are finished and will be published unchanged: the key is the
    file's identity, which a rename or a hard link keeps and a rewrite changes."""
    root = Path(root)
    entries = [(_identity(root / name), digest) for name, digest in digests.items()]
    with _digests_lock:
        _published_digests.update(entries)


def sha256_tree(path: str | os.PathLike) -> str:
    """One hash over a directory: sorted relative names and their file hashes (``published_sha256``)."""
    root = Path(path)
    files = sorted(x for x in root.rglob("*") if x.is_file() and x.name != COMPLETE)
    h = hashlib.sha256()
    for p, digest in zip(files, published_sha256(files)):
        h.update(str(p.relative_to(root)).encode() + b"\0" + digest.encode() + b"\n")
    return h.hexdigest()


def fsync_tree(path: Path) -> None:
    if path.is_file():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        return
    for p in sorted(path.rglob("*"), reverse=True):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArtifactStore:
    """root: a local path, ``file://`` URL or any fsspec URL. Paths inside are relative (``rel``)."""

    def __init__(self, root: str | os.PathLike):
        root = str(root)
        try:
            self.fs, base = fsspec.core.url_to_fs(root)
        except ImportError as e:  # the protocol's package is not installed (s3fs for s3://)
            raise ArtifactRootError(f"artifact root {root}: {e} (for s3://: pip install 'k3rl[s3]', "
                                    f"which brings s3fs)") from None
        self.is_local = isinstance(self.fs, LocalFileSystem)
        if self.is_local:
            self.base = os.path.abspath(base)
            self.root = self.base
            self.cache = Path(self.base)
        else:
            self.base = base.rstrip("/")
            self.root = root.rstrip("/")
            key = hashlib.sha256(self.root.encode()).hexdigest()[:16]
            self.cache = Path(os.environ.get("K3RL_CACHE_DIR", Path.home() / ".cache" / "k3rl")) / key

    # ----------------------------------------------------------------- names
    def uri(self, rel: str) -> str:
        """A URI that is also a valid Prefect asset key (``file:///abs/path``, ``s3://b/k``, ...)."""
        if self.is_local:
            return Path(self.base, rel).as_uri()
        return f"{self.root}/{rel}"

    def local_path(self, rel: str) -> Path:
        return self.cache / rel

    def _local(self, rel: str) -> Path:
        """This machine's path of ``rel`` (the root itself, or the cache of a remote root), refused
        (``ArtifactPathError``) where a symbolic link on the way leads outside it: k3rl writes and
        deletes only inside its root, and a link planted under it must not carry a publish, or a
        retention pass's delete, to a directory elsewhere."""
        top = self.base if self.is_local else str(self.cache)
        p = Path(top, rel)
        real, inside = os.path.realpath(p), os.path.realpath(top)
        if real != inside and not real.startswith(inside.rstrip("/") + "/"):
            raise ArtifactPathError(f"{p} leads outside the artifact root {top} through a symbolic link (to {real}): "
                                    "k3rl writes and deletes only inside its root; replace the link by the directory "
                                    "it names (move it in), or use that directory's root as --artifacts")
        return p

    def _remote(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    # ----------------------------------------------------------------- state
    def exists(self, rel: str) -> bool:
        if self.is_local:
            p = Path(self.base, rel)
            return p.is_file() or (p.is_dir() and (p / COMPLETE).exists())
        r = self._remote(rel)
        with storage_call("read", self.uri(rel)):
            # the storage's answer, not a listing this process cached before another one published
            self.fs.invalidate_cache(r)
            return self.fs.isfile(r) or self.fs.exists(f"{r}/{COMPLETE}")

    @contextlib.contextmanager
    def publish(self, rel: str, is_dir: bool = False):
        """Yield a temporary local path to build the artifact in; publish it atomically on success,
        delete it on failure. If the artifact already exists, the new build is discarded."""
        final = self._local(rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / staging_name(".tmp-", final.name)
        if is_dir:
            tmp.mkdir()
        try:
            yield tmp
            faults.reached("mid-write", tmp)
            if is_dir:
                (tmp / COMPLETE).write_text("")
            fsync_tree(tmp)
            faults.reached("before-publish", tmp)
            if self.is_local:
                if self.exists(rel):
                    return
                if is_dir:
                    if final.exists():  # an incomplete leftover from a crashed publish
                        shutil.rmtree(final)
                    os.rename(tmp, final)
                else:
                    os.replace(tmp, final)
                fsync_dir(final.parent)
            else:
                if self.exists(rel):  # already published: keep the remote and its local copy
                    return
                self._upload(tmp, rel, is_dir)
                if final.exists():
                    shutil.rmtree(final) if final.is_dir() else final.unlink()
                os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()

    def _upload(self, tmp: Path, rel: str, is_dir: bool) -> None:
        """Publish the local build ``tmp`` as remote ``rel``: a file through a temporary key and a
        move, a directory file by file and its marker last. On failure nothing stays under ``rel``
        that a reader would take for the artifact (and, where the storage lets us, nothing at all)."""
        r = self._remote(rel)
        if not is_dir:
            self._put_via_temp(tmp, rel)
            return
        with storage_call("write", self.uri(rel)):
            # objects of an earlier publish that never got its marker (one writer per artifact: the run lock)
            if self.fs.exists(r) and not self.fs.exists(f"{r}/{COMPLETE}"):
                self.fs.rm(r, recursive=True)
        try:
            for p in sorted(tmp.rglob("*")):
                if p.is_file() and p.name != COMPLETE:
                    key = p.relative_to(tmp).as_posix()
                    with storage_call("write", self.uri(f"{rel}/{key}")):
                        self.fs.makedirs(f"{r}/{p.parent.relative_to(tmp).as_posix()}".rstrip("/."), exist_ok=True)
                        self.fs.put_file(str(p), f"{r}/{key}")
            with storage_call("write", self.uri(f"{rel}/{COMPLETE}")):
                self.fs.pipe_file(f"{r}/{COMPLETE}", b"")  # the marker last: readers trust only complete dirs
        except BaseException:
            self._remove_quietly(r, recursive=True)
            raise

    def _put_via_temp(self, local: Path, rel: str) -> None:
        """Upload ``local`` to a hidden temporary key beside ``rel``, then move it onto ``rel``: no
        reader ever sees a partly written object under the final key, whatever the filesystem."""
        r = self._remote(rel)
        parent, name = r.rsplit("/", 1) if "/" in r else ("", r)
        temp = f"{parent}/.tmp-{name}-{uuid.uuid4().hex[:8]}" if parent else f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        try:
            with storage_call("write", self.uri(rel)):
                self.fs.put_file(str(local), temp)
                self.fs.mv(temp, r)
        except BaseException:
            self._remove_quietly(temp)
            raise
        finally:
            self.fs.invalidate_cache(r)

    def _remove_quietly(self, path: str, recursive: bool = False) -> None:
        """Best-effort cleanup after a failed publish. The storage may refuse it too (the same denied
        credentials); what stays is then a directory without its marker, which no reader takes and
        the next publish clears, or a hidden temporary key, which no reader looks at."""
        with contextlib.suppress(Exception):
            self.fs.rm(path, recursive=recursive)
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(path)

    def open_local(self, rel: str) -> Path:
        """A local path holding the published artifact (downloaded once for remote roots)."""
        if not self.exists(rel):
            raise FileNotFoundError(f"artifact {self.uri(rel)} does not exist or was never completely published")
        if self.is_local:
            return Path(self.base, rel)
        local = self.cache / rel
        if local.exists():
            return local
        r = self._remote(rel)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.parent / staging_name(".dl-", local.name)
        try:
            with storage_call("read", self.uri(rel)):
                if self.fs.isfile(r):
                    self.fs.get_file(r, str(tmp))
                else:
                    self.fs.get(r, str(tmp), recursive=True)
            fsync_tree(tmp)
            os.rename(tmp, local)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        return local

    def rel_of(self, uri: str) -> str | None:
        """The ``rel`` of an artifact URI under this root (None: elsewhere)."""
        prefix = self.uri("")
        return uri[len(prefix):].strip("/") if uri.startswith(prefix) and len(uri) > len(prefix) else None

    def localize(self, artifact: Artifact) -> Artifact:
        """``artifact`` with a ``path`` that exists on this machine: as it is when it does, else the
        same sub-path of this machine's copy of it, downloaded from the root (a handle recorded by
        another machine, or before this machine's cache was emptied)."""
        if Path(artifact.path).exists():
            return artifact
        rel = self.rel_of(artifact.uri)
        if rel is None:
            return artifact
        inner = inner_path(artifact.path, rel)
        local = self.open_local(rel)
        return replace(artifact, path=str(local / inner if inner else local))

    def check_access(self) -> None:
        """Fail before any work when this root cannot hold artifacts: write a small object at the
        root, read it back and remove it. Raises ``ArtifactRootError`` (a ``ValueError``) naming the
        root, the cause and the fix."""
        probe = f".k3rl-access-check-{uuid.uuid4().hex[:8]}"
        try:
            if self.is_local:
                with storage_call("write", self.uri(probe)):
                    os.makedirs(self.base, exist_ok=True)
                    p = Path(self.base, probe)
                    p.write_bytes(b"k3rl")
                    ok = p.read_bytes() == b"k3rl"
                    p.unlink()
            else:
                r = self._remote(probe)
                with storage_call("write", self.uri(probe)):
                    self.fs.pipe_file(r, b"k3rl")
                with storage_call("read", self.uri(probe)):
                    ok = self.fs.cat_file(r) == b"k3rl"
                self._remove_quietly(r)
        except StorageError as e:
            raise ArtifactRootError(f"artifact root {self.root} is not usable: {e}") from e
        if not ok:
            raise ArtifactRootError(f"artifact root {self.root} is not usable: an object written there read back "
                                    f"different; check the storage")

    def publish_once(self, rel: str, build: Callable[[Path], None], is_dir: bool = False) -> Path:
        """The local path of artifact ``rel``, built by ``build(tmp)`` and published atomically the
        first time; later calls (a retried or re-run stage) find it and build nothing."""
        if not self.exists(rel):
            with self.publish(rel, is_dir=is_dir) as tmp:
                build(tmp)
        return self.open_local(rel)

    def handle(self, rel: str, kind: str, version: int | None = None, inner: str = "", **info: Any) -> Artifact:
        """The ``Artifact`` for published ``rel`` (``inner``: the sub-path the consumer reads, e.g. the
        checkpoint directory inside a published directory); sha256 of the file or the whole tree."""
        local = self.open_local(rel)
        path = local / inner if inner else local
        sha = published_sha256([path])[0] if path.is_file() else sha256_tree(path)
        return Artifact(kind=kind, uri=self.uri(rel), path=str(path), sha256=sha, version=version, info=info)

    def write_text(self, rel: str, text: str) -> str:
        with self.publish(rel) as tmp:
            tmp.write_text(text)
        return self.uri(rel)

    def replace_text(self, rel: str, text: str) -> str:
        """Overwrite (not idempotent): used for pointers such as ``latest``, updated last. A reader
        sees the old text or the new, never a mix (temporary name, then one move)."""
        final = self._local(rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / staging_name(".tmp-", final.name)
        try:
            tmp.write_text(text)
            fsync_tree(tmp)
            if not self.is_local:
                self._put_via_temp(tmp, rel)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(final.parent)
        return self.uri(rel)

    def remove(self, rel: str) -> bool:
        """Delete published artifact ``rel`` (retention). A directory loses its ``_COMPLETE`` marker
        first, so a crash midway leaves an unpublished leftover that no reader trusts and a later
        publish of the same name replaces, never a directory that looks whole and is not. The local
        cache copy of a remote artifact goes with it. False when there was nothing to delete."""
        local = self._local(rel)
        found = self.exists(rel) or local.exists()
        if not self.is_local:
            r = self._remote(rel)
            with storage_call("delete", self.uri(rel)):
                if self.fs.isfile(r):
                    self.fs.rm_file(r)
                elif self.fs.exists(r):
                    if self.fs.exists(f"{r}/{COMPLETE}"):
                        self.fs.rm_file(f"{r}/{COMPLETE}")
                    self.fs.rm(r, recursive=True)
            self.fs.invalidate_cache(r)
        if local.is_dir():
            (local / COMPLETE).unlink(missing_ok=True)
            fsync_dir(local)
            shutil.rmtree(local)
        elif local.exists():
            local.unlink()
        return found

    def remove_dead_staging(self, rel: str) -> list[Path]:
        """Delete the staging paths under ``rel`` (this machine's side: the root itself, or the local
        cache of a remote root) whose writer was a process of this host that no longer runs. Staging
        of live processes and of other hosts is left alone, so this is safe beside running writers."""
        top = self._local(rel)
        if not top.is_dir():
            return []
        removed = []
        for dirpath, dirnames, filenames in os.walk(top):
            for name in [*dirnames, *filenames]:
                writer = staging_writer(name)
                if writer is None or writer[0] != _HOST or _alive(writer[1]):
                    continue
                p = Path(dirpath, name)
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                removed.append(p)
            dirnames[:] = [d for d in dirnames if staging_writer(d) is None]  # never descend into staging
        return removed

    def read_text(self, rel: str) -> str:
        if self.is_local:
            return Path(self.base, rel).read_text()
        with storage_call("read", self.uri(rel)):  # a missing object: StorageNotFound, a FileNotFoundError
            return self.fs.cat_file(self._remote(rel)).decode()


def inner_path(path: str, rel: str) -> str:
    """The sub-path a handle's ``path`` reads inside its published ``rel`` (e.g. ``state`` of a
    checkpoint directory), wherever the root it was recorded under lies; "" for ``rel`` itself."""
    parts, want = PurePosixPath(path).parts, tuple(rel.split("/"))
    ends = [i + len(want) for i in range(len(parts) - len(want) + 1) if parts[i:i + len(want)] == want]
    return "/".join(parts[ends[-1]:]) if ends else ""


class ArtifactPathError(ValueError):
    """A path under the artifact root that a symbolic link leads outside it: bad input, named with
    the fix, before anything is written or deleted there."""


def links_leaving(root: str | os.PathLike, rel: str) -> list[tuple[Path, str]]:
    """(link, where it leads) for each symbolic link under local ``root``/``rel`` (not followed)
    whose target resolves outside ``root``: what ``ArtifactStore`` refuses to write or delete
    through, listed before a run starts."""
    inside = os.path.realpath(root).rstrip("/") + "/"
    out = []
    for dirpath, dirnames, filenames in os.walk(Path(root, rel)):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath, name)
            if p.is_symlink() and not (os.path.realpath(p) + "/").startswith(inside):
                out.append((p, os.path.realpath(p)))
    return out


class ArtifactRootError(ValueError):
    """An artifact root that cannot hold artifacts (missing bucket, access denied, read-only):
    bad input, found before any work."""


@dataclass(frozen=True)
class Artifact:
    """What stages hand each other: one published artifact.

    ``kind``: ``hf`` (public-layout bf16 checkpoint), ``hf-mxfp4`` (routed experts MXFP4), ``dcp``
    (a trainer state: model, optimizer, RNG, run metadata), ``rollouts``/``scored`` (Parquet tables),
    ``report`` (JSON), ``engine`` (weights live in a rollout engine; ``uri`` is ``engine://run@vN``).
    ``version``: the policy weight version the artifact holds or was produced at. ``path``: where a
    consumer on this machine reads it. ``info``: small facts about it (row counts, metrics).
    ``produced_by`` and ``inputs``: the task run that published it and the URIs it read (lineage);
    ``produced_by_id``: that task run's id, where an orchestrator ran it (the UI links to it)."""

    kind: str
    uri: str
    path: str
    sha256: str
    version: int | None = None
    info: dict = field(default_factory=dict, compare=False)
    produced_by: str = ""
    inputs: tuple[str, ...] = ()
    produced_by_id: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "inputs": list(self.inputs)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Artifact:
        return cls(**{**d, "inputs": tuple(d.get("inputs", ()))})
