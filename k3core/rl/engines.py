"""The process's live embedded rollout engines, one per run id (the embedded engine's "server").

Owns: the registry (``get``, ``put``, ``clear``). A transfer pushes new weights into the live engine;
a rollout uses it when its version, device and decode mode are the ones asked for, and otherwise (a
fresh process after a crash, a skipped cached transfer) rebuilds it from the durable artifact of that
version. Correctness never depends on this registry: it only saves work. Does not own: building or
filling an engine (``k3core.rl.weights``, ``k3core.transfer``), the resident engines of worker
processes (``k3core.rl.resident``).
"""

from __future__ import annotations

import threading

__all__ = ["clear", "get", "put"]

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
