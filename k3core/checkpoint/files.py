"""Durable file operations shared by the checkpoint writer, fetcher and validator.

Owns: fsync of files and directories, atomic publication of a file (temporary name in the same
directory, fsync, rename, directory fsync), atomic publication of a whole directory (rename, or an
atomic exchange with ``renameat2(RENAME_EXCHANGE)`` when a previous version is in place), and
streaming sha256 with a bounded buffer.

Why directories: a checkpoint is many shards plus an index. Writing the new shards over an old
checkpoint's shards in place would leave the old index naming rewritten files if the writer died;
staging the new version beside it and swapping the directory in one step keeps the old checkpoint
whole until the new one is complete.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import socket
import uuid
import warnings
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_NAME", "INDEX_NAME", "fsync_dir", "atomic_write_bytes", "atomic_write_json", "sha256_file", "staging_dir_for",
           "publish_dir", "remove_stale_staging", "HASH_CHUNK"]

# The two small files that make a directory a checkpoint (the index names every shard).
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
HASH_CHUNK = 8 << 20  # 8 MiB: the most a hash ever holds in memory


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames inside it survive a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sha256_file(path: str | os.PathLike, chunk: int = HASH_CHUNK) -> str:
    """Hex sha256 of a file, read ``chunk`` bytes at a time (memory bounded by ``chunk``)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _staging_prefix(final: Path) -> str:
    return f".{final.name}.partial-"


def staging_dir_for(final: str | os.PathLike) -> Path:
    """A fresh, empty sibling directory to build the next version of ``final`` in."""
    final = Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    d = final.parent / f"{_staging_prefix(final)}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    return d


def remove_stale_staging(final: str | os.PathLike) -> list[Path]:
    """Delete staging directories of ``final`` left by writers of this host that died (their pid is
    gone). Staging directories of other hosts or of live processes are left alone."""
    final = Path(final).absolute()
    removed = []
    if not final.parent.is_dir():
        return removed
    host = socket.gethostname()
    for d in final.parent.glob(_staging_prefix(final) + "*"):
        tag = d.name[len(_staging_prefix(final)):]
        parts = tag.rsplit("-", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def publish_dir(staging: Path, final: str | os.PathLike, keep: callable | None = None) -> None:
    """Make the complete ``staging`` directory appear at ``final`` in one step.

    ``final`` absent or empty: one rename. Otherwise the entries of the old ``final`` for which
    ``keep(name)`` is true (files the writer does not own, e.g. a tokenizer) are hard-linked into
    ``staging`` first, then the two directories are exchanged atomically and the old version is
    deleted. Without ``renameat2`` the fallback is two renames; a crash between them leaves the old
    version whole under a ``.old-`` name instead of ``final`` (never a mixed directory)."""
    final = Path(final).absolute()
    for root, _, files in os.walk(staging):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)
    if final.is_dir() and keep is not None:
        for name in os.listdir(final):
            if keep(name) and not (staging / name).exists():
                src = final / name
                if src.is_dir() and not src.is_symlink():
                    shutil.copytree(src, staging / name, symlinks=True, copy_function=_link_or_copy)
                else:
                    _link_or_copy(str(src), str(staging / name))
        fsync_dir(staging)
    if not os.path.lexists(final):
        os.rename(staging, final)
    elif final.is_dir() and not any(final.iterdir()):
        os.rename(staging, final)  # rename(2) replaces an empty directory atomically
    elif _exchange(staging, final):
        shutil.rmtree(staging)  # staging now holds the previous version
    else:
        warnings.warn(f"atomic directory exchange is not supported for {final}; replacing it with two renames",
                      RuntimeWarning, stacklevel=2)
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old)
    fsync_dir(final.parent)
