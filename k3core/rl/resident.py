"""Resident engine workers of a fanned-out rollout (``--task-runner dask|ray``): the processes that
keep a ``k3core.rl.shards.ResidentEngines`` (engines built once per worker, pushed each newer weight
version) and run rollout shards on it.

Owns: on Dask, the worker plugin that gives each worker process its ``ResidentEngines``; on Ray, the
run's engine actors (``EngineActor``, ``start_actors``) and the failover of a shard from a dead actor
to the next (``actor_rows``), because prefect-ray runs tasks in whichever pooled Ray worker process
is free and only an actor pins state to one process; ``shard_rows``, which runs a shard wherever the
calling task landed. Does not own: cutting and merging shards (``k3core.rl.shards``), publishing them
or placing their tasks (the orchestration layer: ``tasks.rollout``, ``flows.scale``). Dask and Ray
are imported only when a function that needs them runs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

_lock = threading.Lock()


# ---- resident engines of Dask workers -----------------------------------------------------------------

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


def shard_rows(req, shard: int, shards: int, warn: Callable[[str], None] | None = None):
    """(the rows of rollout shard ``req``, the worker that made them): on a Ray worker, by the run's
    engine actors (``actor_rows``, which reports a failover through ``warn``); elsewhere (a Dask
    worker, or this process) on this process's resident engines."""
    if in_ray_worker():
        return actor_rows(req, shard, shards, warn)
    holder, worker = resident_engines()
    return holder.rollout(req, worker), worker


# ---- resident engines as Ray actors (rollout shards on --task-runner ray) ----------------------------------

RAY_NAMESPACE = "k3rl"


def in_ray_worker() -> bool:
    """Whether this code runs in a Ray worker process (a task prefect-ray placed there)."""
    import sys

    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


def actor_name(run_id: str, k: int) -> str:
    return f"k3rl-engines-{run_id}-{k}"


class EngineActor:
    """The body of one engine actor (``ray.remote`` makes it one in ``start_actors``): a
    ``ResidentEngines`` in its own process with one torch thread. ``rollout`` calls run one at a
    time (a lock: a shard that failed over can land on an actor already busy); ``status`` answers
    beside them (the actor runs 2 threads) with the process id, the shards in flight and the engines'
    builds, pushes and versions."""

    def __init__(self, worker: str):
        import torch

        from k3core.rl.shards import ResidentEngines

        torch.set_num_threads(1)
        self.worker = worker
        self.engines = ResidentEngines()
        self._one = threading.Lock()  # one shard generating at a time
        self._count = threading.Lock()  # guards busy, which both threads change
        self.busy = 0

    def rollout(self, req):
        with self._count:
            self.busy += 1
        try:
            with self._one:
                return self.engines.rollout(req, self.worker)
        finally:
            with self._count:
                self.busy -= 1

    def status(self) -> dict:
        return {"worker": self.worker, "pid": os.getpid(), "busy": self.busy, "builds": self.engines.builds,
                "pushes": self.engines.pushes, "versions": self.engines.versions()}


def start_actors(run_id: str, n: int) -> list:
    """The run's ``n`` engine actors ``ray-0`` ... ``ray-{n-1}``, named so that the shard tasks find
    them (``actor_name``). They hold no CPU of Ray's accounting (the shard task that calls one does:
    one task per CPU), are spread over the cluster's nodes, and a dead one is restarted (a fresh
    process that builds its engine again at the next shard)."""
    import ray

    cls = ray.remote(EngineActor)
    return [cls.options(name=actor_name(run_id, k), namespace=RAY_NAMESPACE, num_cpus=0, max_concurrency=2,
                        max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD").remote(f"ray-{k}")
            for k in range(n)]


def actor_rows(req, shard: int, shards: int, warn: Callable[[str], None] | None = None):
    """Shard ``req`` on actor ``shard`` of the run's ``shards``; when that actor dies under it (its
    process killed, its node lost), on the next one, and so on: a dead worker costs only its shard,
    and ``warn`` (default: this module's logger) is told which actor died. An error the shard raises
    itself (a stale weight version, a bug) is raised here."""
    import ray

    warn = warn or logging.getLogger(__name__).warning

    errors = []
    for j in range(shards):
        name = actor_name(req.run_id, (shard + j) % shards)
        try:
            actor = ray.get_actor(name, namespace=RAY_NAMESPACE)
        except ValueError as e:
            errors.append(f"{name}: {e}")
            continue
        try:
            table = ray.get(actor.rollout.remote(req))
        except ray.exceptions.RayActorError as e:
            warn(f"engine actor {name} died during rollout shard {shard} of {shards} "
                              f"({type(e).__name__}); running the shard on the next actor")
            errors.append(f"{name}: {type(e).__name__}")
            continue
        return table, table.column("worker")[0].as_py() if table.num_rows else f"ray-{(shard + j) % shards}"
    raise RuntimeError(f"no engine actor of run {req.run_id!r} could run rollout shard {shard} of {shards} "
                       f"(started by flows.scale for --task-runner ray): {'; '.join(errors)}")

