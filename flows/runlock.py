"""The per-run lock of ``rl_continue`` and the count of finished iterations; no Prefect, no torch
(cheap to import in a process that only ticks a lock).

``run_lock`` takes an exclusive, non-blocking ``flock`` on ``<artifacts>/runs/<run_id>/.lock`` (for a
remote artifact root, on the same path in the local artifact cache: one machine's guarantee there).
The kernel drops the lock when its holder exits, however it exits, so a crashed tick never blocks
the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from collections.abc import Iterator


def lock_path(artifacts: str, run_id: str) -> Path:
    """The lock file of a run: inside the run directory for a local root, else in the local cache."""
    from k3core.artifacts import ArtifactStore

    store = ArtifactStore(artifacts)
    base = Path(store.base) if store.is_local else store.cache
    return base / "runs" / run_id / ".lock"


@contextlib.contextmanager
def run_lock(artifacts: str, run_id: str) -> Iterator[bool]:
    """Yield True while holding the run's exclusive lock, False (at once, without waiting) if another
    holder has it. ``flock`` locks belong to the open file, so two holders conflict whether they are
    threads of one process or separate processes."""
    path = lock_path(artifacts, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())  # who holds it, for a person looking
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def iterations_done(artifacts: str, run_id: str) -> int:
    """Iterations whose checkpoint is published (``latest.json``); 0 for a run never started."""
    from k3core.artifacts import ArtifactStore

    store = ArtifactStore(artifacts)
    rel = f"runs/{run_id}/latest.json"
    if not store.exists(rel):
        return 0
    return int(json.loads(store.read_text(rel))["iteration"])
