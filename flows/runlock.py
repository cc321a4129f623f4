"""The per-run lock of ``rl_continue`` and the count of finished iterations; no Prefect, no torch
(cheap to import in a process that only ticks a lock).

``run_lock`` takes an exclusive, non-blocking ``flock`` on ``<artifacts>/runs/<run_id>/.lock`` (for a
remote artifact root, on the same path in the local artifact cache: one machine's guarantee there).
The kernel drops the lock when its holder exits, however it exits, so a crashed tick never blocks
the next one.

The lock file records its holder (``pid N``) while held and is emptied on a clean release, so a
second process can name the holder it found busy, and a process that finds a pid left in the file
knows it took over from a holder that died holding the lock (kill -9, OOM): ``RunLock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator


def lock_path(artifacts: str, run_id: str) -> Path:
    """The lock file of a run: inside the run directory for a local root, else in the local cache."""
    from k3core.artifacts import ArtifactStore
    from k3core.rl.layout import RunLayout

    store = ArtifactStore(artifacts)
    base = Path(store.base) if store.is_local else store.cache
    return base / RunLayout(run_id).lock


@dataclass(frozen=True)
class RunLock:
    """What ``run_lock`` found. True (``bool``) while this process holds the lock. ``holder``: the pid
    recorded by the process holding it, when busy (None if it has not written it yet).
    ``took_over_from``: the pid of a previous holder that died without releasing the lock."""

    held: bool
    path: Path
    holder: int | None = None
    took_over_from: int | None = None

    def __bool__(self) -> bool:
        return self.held


def _recorded_pid(fd: int) -> int | None:
    os.lseek(fd, 0, os.SEEK_SET)
    m = re.match(rb"pid (\d+)", os.read(fd, 64))
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def run_lock(artifacts: str, run_id: str) -> Iterator[RunLock]:
    """Yield a true ``RunLock`` while holding the run's exclusive lock, a false one (at once, without
    waiting) if another holder has it. ``flock`` locks belong to the open file, so two holders
    conflict whether they are threads of one process or separate processes."""
    path = lock_path(artifacts, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield RunLock(False, path, holder=_recorded_pid(fd))
            return
        dead = _recorded_pid(fd)  # a clean release empties the file: a pid here died holding the lock
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        try:
            yield RunLock(True, path, took_over_from=dead)
        finally:
            os.ftruncate(fd, 0)  # before the unlock: whoever takes it next finds no holder recorded
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def iterations_done(artifacts: str, run_id: str) -> int:
    """Iterations whose checkpoint is published (``latest.json``); 0 for a run never started."""
    from k3core.artifacts import ArtifactStore
    from k3core.rl.layout import RunLayout

    store = ArtifactStore(artifacts)
    rel = RunLayout(run_id).latest
    if not store.exists(rel):
        return 0
    return int(json.loads(store.read_text(rel))["iteration"])
