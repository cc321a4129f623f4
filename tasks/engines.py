"""The process's live rollout engines, one per run id (the embedded engine's "server").

A transfer pushes new weights into the live engine; a rollout uses it when its version is the one
asked for, and otherwise (a fresh process after a crash, a skipped cached transfer) rebuilds it from
the durable artifact of that version. Correctness never depends on this registry: it only saves work.

Rollout shards on Dask workers (``--task-runner dask``) use ``resident_engines()``: the worker
plugin's ``k3core.rl.shards.ResidentEngines``, built once per worker process and pushed each newer
weight version.
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


# ---- resident engines of Dask workers (rollout shards, tasks.rollout.rollout_shard) -------------------

PLUGIN_NAME = "k3rl-engines"
_process_engines = None


def worker_plugin():
    """A Dask ``WorkerPlugin`` that gives each worker process its ``ResidentEngines`` (engines kept
    across rollouts, pushed each new weight version) and one torch thread per Dask thread, so N
    single-threaded workers share the cores without oversubscribing them. Registered once per run
    on the cluster (``flows.scale``); workers that join or restart later get it too."""
    from distributed import WorkerPlugin

    class EnginePlugin(WorkerPlugin):
        name = PLUGIN_NAME

        def setup(self, worker):
            import torch

            from k3core.rl.shards import ResidentEngines

            torch.set_num_threads(max(1, worker.state.nthreads))
            self.engines = ResidentEngines()

        def teardown(self, worker):
            self.engines = None

    return EnginePlugin()


def resident_engines():
    """(the ``ResidentEngines`` of this process, the worker's name for the rollout table): the Dask
    worker's plugin when running on one, else one holder for this process (named "local")."""
    global _process_engines
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        worker = None
    if worker is not None and PLUGIN_NAME in worker.plugins:
        return worker.plugins[PLUGIN_NAME].engines, str(worker.name)
    with _lock:
        if _process_engines is None:
            from k3core.rl.shards import ResidentEngines

            _process_engines = ResidentEngines()
        return _process_engines, "local" if worker is None else str(worker.name)
