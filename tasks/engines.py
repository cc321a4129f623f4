"""The process's live rollout engines, one per run id (the embedded engine's "server").

A transfer pushes new weights into the live engine; a rollout uses it when its version is the one
asked for, and otherwise (a fresh process after a crash, a skipped cached transfer) rebuilds it from
the durable artifact of that version. Correctness never depends on this registry: it only saves work.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_engines: dict[str, object] = {}


def get(run_id: str):
    with _lock:
        return _engines.get(run_id)


def put(run_id: str, engine) -> None:
    with _lock:
        _engines[run_id] = engine


def clear() -> None:
    with _lock:
        _engines.clear()
