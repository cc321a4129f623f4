"""Artifact store: atomic publication of files and directories under one root, local or fsspec.

Every artifact is built at a temporary local name, fsync'ed, then published in one step:
``os.replace`` for a local file, ``os.rename`` of the whole directory for a local directory, and for
remote roots (``memory://``, ``s3://``, ...) an upload of every file followed by a ``_COMPLETE``
marker written last. A reader only trusts a directory that has its marker, so a crash at any point
leaves either the previous state or the new, complete artifact, never a half-written one where a
good one is expected. Publishing an artifact that already exists is a no-op (idempotent stages).

A process killed mid-publish (kill -9, OOM, power) leaves its staging path behind. Staging names
carry the writer's host and pid (``.tmp-<name>.<host>.<pid>.<nonce>``), so ``remove_dead_staging``
deletes exactly the leftovers of writers of this host that are gone, never a live writer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from k3core import faults

COMPLETE = "_COMPLETE"
STAGING_PREFIXES = (".tmp-", ".dl-")
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def staging_name(prefix: str, name: str) -> str:
    """A fresh staging name for ``name``, owned by this process of this host."""
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


def sha256_file(path: str | os.PathLike, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(path: str | os.PathLike) -> str:
    """One hash over a directory: sorted relative names and their file hashes."""
    root = Path(path)
    h = hashlib.sha256()
    for p in sorted(x for x in root.rglob("*") if x.is_file() and x.name != COMPLETE):
        h.update(str(p.relative_to(root)).encode() + b"\0" + sha256_file(p).encode() + b"\n")
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
        self.fs, base = fsspec.core.url_to_fs(root)
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

    def _remote(self, rel: str) -> str:
        return f"{self.base}/{rel}"

    # ----------------------------------------------------------------- state
    def exists(self, rel: str) -> bool:
        if self.is_local:
            p = Path(self.base, rel)
            return p.is_file() or (p.is_dir() and (p / COMPLETE).exists())
        r = self._remote(rel)
        return self.fs.isfile(r) or self.fs.exists(f"{r}/{COMPLETE}")

    @contextlib.contextmanager
    def publish(self, rel: str, is_dir: bool = False):
        """Yield a temporary local path to build the artifact in; publish it atomically on success,
        delete it on failure. If the artifact already exists, the new build is discarded."""
        final = Path(self.base if self.is_local else self.cache, rel)
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
        r = self._remote(rel)
        if not is_dir:
            self.fs.put_file(str(tmp), r)
            return
        for p in sorted(tmp.rglob("*")):
            if p.is_file() and p.name != COMPLETE:
                self.fs.makedirs(f"{r}/{p.parent.relative_to(tmp)}".rstrip("/."), exist_ok=True)
                self.fs.put_file(str(p), f"{r}/{p.relative_to(tmp)}")
        self.fs.pipe_file(f"{r}/{COMPLETE}", b"")  # the marker last: readers trust only complete dirs

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
        if self.fs.isfile(r):
            self.fs.get_file(r, str(tmp))
        else:
            self.fs.get(r, str(tmp), recursive=True)
        os.rename(tmp, local)
        return local

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
        sha = sha256_file(path) if path.is_file() else sha256_tree(path)
        return Artifact(kind=kind, uri=self.uri(rel), path=str(path), sha256=sha, version=version, info=info)

    def write_text(self, rel: str, text: str) -> str:
        with self.publish(rel) as tmp:
            tmp.write_text(text)
        return self.uri(rel)

    def replace_text(self, rel: str, text: str) -> str:
        """Overwrite (not idempotent): used for pointers such as ``latest``, updated last."""
        final = Path(self.base if self.is_local else self.cache, rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / staging_name(".tmp-", final.name)
        tmp.write_text(text)
        fsync_tree(tmp)
        if not self.is_local:
            self.fs.put_file(str(tmp), self._remote(rel))
        os.replace(tmp, final)
        fsync_dir(final.parent)
        return self.uri(rel)

    def remove_dead_staging(self, rel: str) -> list[Path]:
        """Delete the staging paths under ``rel`` (this machine's side: the root itself, or the local
        cache of a remote root) whose writer was a process of this host that no longer runs. Staging
        of live processes and of other hosts is left alone, so this is safe beside running writers."""
        top = Path(self.base if self.is_local else self.cache, rel)
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
        return self.fs.cat_file(self._remote(rel)).decode()


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
