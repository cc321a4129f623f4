"""The task runner of a run's iteration flows (``--task-runner``): where rollout shards and sandboxed
reward calls run.

- ``local``: Prefect's default runner; every stage runs in the flow's process.
- ``dask``: prefect-dask's ``DaskTaskRunner`` on one Dask cluster for the whole run: a
  ``LocalCluster`` of ``--rollout-workers`` single-threaded worker processes on this machine
  (loopback), or the scheduler at ``--dask-address``. The cluster outlives each iteration's flow,
  so every worker keeps its rollout engine resident across iterations (the worker plugin of
  ``k3core.rl.resident``); each iteration flow joins it with a runner of its own.
- ``ray``: prefect-ray's ``RayTaskRunner`` on one Ray instance for the whole run: a local one of
  ``--rollout-workers`` CPUs (this process starts it: ``ray.init``), or the cluster at
  ``--ray-address``; and ``--rollout-workers`` engine actors (``k3core.rl.resident.EngineActor``) that
  live as long as the run, which the shard tasks call. prefect-ray places tasks in pooled worker
  processes of its choosing, so the engines that must stay resident live in actors, not in tasks.
  Each iteration flow's runner finds Ray initialised in this process and uses it (it then neither
  starts nor stops it).

Workers import ``tasks`` and ``k3core`` from their own Python path: on a cluster started elsewhere,
the same checkout or package must be installed on every worker, and the artifact root must be a
location every worker and the flow can read and write (a shared filesystem or an fsspec URL). The
same holds for a user environment (``--env module.path:factory``): its reward calls run on the
workers. A LocalCluster's workers get this process's ``sys.path`` from multiprocessing, a local Ray
instance's through ``PYTHONPATH`` (``_import_path``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from k3core.settings import ScaleOutSettings

__all__ = ["check_dask", "check_ray", "check_runner", "iteration_runner"]

# The object store of a local Ray instance: shard tables and task results are small (kilobytes to a
# few MiB); Ray's default, 30% of memory, would reserve gigabytes of /dev/shm on a shared machine.
RAY_OBJECT_STORE_BYTES = 256 * 2**20


def check_runner(scale: ScaleOutSettings, timeout: float = 10.0) -> None:
    """``check_dask`` and ``check_ray``: the runner's packages are installed and its address answers."""
    check_dask(scale, timeout)
    check_ray(scale, timeout)


def _connect(flag: str, host: str | None, port: int | None, timeout: float, nobody: str, hint: str) -> None:
    """``ValueError`` "``flag``: ``nobody`` (the reason); ``hint``" unless a TCP connection opens."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except (OSError, TypeError, ValueError) as e:
        raise ValueError(f"{flag}: {nobody} ({e}); {hint}") from None


def check_ray(scale: ScaleOutSettings, timeout: float = 10.0) -> None:
    """Bad usage found before any work (``ValueError``: the CLI exits 2): ray or prefect-ray not
    installed, or nothing answering at ``--ray-address`` (``auto`` is left to Ray)."""
    if scale.task_runner != "ray":
        return
    try:
        import prefect_ray  # noqa: F401
        import ray  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--task-runner ray needs ray and prefect-ray ({e}): pip install -e '.[scale]'") from None
    if scale.ray_address and scale.ray_address != "auto":
        from urllib.parse import urlsplit

        u = urlsplit(scale.ray_address if "://" in scale.ray_address else f"ray-head://{scale.ray_address}")
        _connect(f"--ray-address {scale.ray_address}", u.hostname, u.port, timeout, "no Ray head answers there",
                 "start a Ray head there (`ray start --head --port PORT`) or leave --ray-address out for a local Ray "
                 "instance")


def check_dask(scale: ScaleOutSettings, timeout: float = 10.0) -> None:
    """Bad usage found before any work (``ValueError``: the CLI exits 2): prefect-dask not installed,
    or no Dask scheduler answering at ``--dask-address``."""
    if scale.task_runner != "dask":
        return
    try:
        import distributed  # noqa: F401
        import prefect_dask  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--task-runner dask needs prefect-dask and distributed ({e}): "
                         "pip install -e '.[scale]'") from None
    if scale.dask_address:
        from urllib.parse import urlsplit

        u = urlsplit(scale.dask_address)
        _connect(f"--dask-address {scale.dask_address}", u.hostname, u.port, timeout,
                 "no Dask scheduler answers there", "start one (`dask scheduler`, then `dask worker ADDRESS --nthreads "
                 "1`) or leave --dask-address out for a LocalCluster on this machine")


# Dask's nannies start workers with MALLOC_TRIM_THRESHOLD_=65536 by default. Setting it at all turns
# off glibc's dynamic mmap threshold, so every large tensor the engine allocates per decode step is a
# fresh mmap with fresh page faults: the engine generated at about half its speed in such a worker.
# None unsets it for the workers of our LocalCluster; `dask worker` processes started by hand need
# the same in their Dask config (docs/scale-out.md gives the file).
NO_MALLOC_TRIM = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"


def _worker_env() -> dict[str, str]:
    """Environment of LocalCluster workers: the Prefect API this flow talks to (in embedded mode, the
    temporary server of this process; otherwise every worker would start a server of its own) and
    one OpenMP thread."""
    env = {"OMP_NUM_THREADS": "1"}
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            env["PREFECT_API_URL"] = str(client.api_url).rstrip("/")
    except Exception:  # no API reachable from here: workers fall back to Prefect's own defaults
        pass
    return env


@contextlib.contextmanager
def iteration_runner(scale: ScaleOutSettings, run_id: str) -> Iterator[Callable[[], object] | None]:
    """For the length of a run: ``None`` (local), or a factory of the task runner of each iteration
    flow: a ``DaskTaskRunner`` joined to the run's cluster with the engine worker plugin registered,
    or a ``RayTaskRunner`` on the run's Ray instance with the run's engine actors started."""
    if scale.task_runner == "ray":
        with _ray_engines(scale, run_id):
            from prefect_ray import RayTaskRunner

            yield RayTaskRunner
        return
    if scale.task_runner != "dask":
        yield None
        return
    check_dask(scale)
    from distributed import Client, LocalCluster
    from prefect_dask import DaskTaskRunner

    from k3core.rl.resident import PLUGIN_NAME, worker_plugin

    with contextlib.ExitStack() as stack:
        address = scale.dask_address
        if not address:
            import dask

            with dask.config.set({NO_MALLOC_TRIM: None}):  # read when the nannies are made
                cluster = stack.enter_context(LocalCluster(n_workers=scale.rollout_workers, threads_per_worker=1,
                                                           processes=True, host="127.0.0.1", dashboard_address=None,
                                                           env=_worker_env()))
            address = cluster.scheduler_address
        client = stack.enter_context(Client(address))
        client.register_plugin(worker_plugin(), name=PLUGIN_NAME)
        yield lambda: DaskTaskRunner(address=address)


def _import_path() -> str:
    """This process's import path beyond the interpreter's own directories (the checkout, a user
    environment's directory, ``PYTHONPATH``), for the workers of a local Ray instance: Ray gives them
    only the driver's script directory and working directory."""
    import os
    import sys

    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    keep = [p for p in sys.path if p and os.path.isdir(p)
            and not any(os.path.realpath(p).startswith(prefix + os.sep) for prefix in own)]
    return os.pathsep.join(dict.fromkeys(keep))


@contextlib.contextmanager
def _ray_engines(scale: ScaleOutSettings, run_id: str) -> Iterator[list]:
    """Ray for the length of a run: initialised in this process unless it already is (a local
    instance of ``--rollout-workers`` CPUs, or a driver of the cluster at ``--ray-address``), and the
    run's engine actors; at the end the actors are killed and Ray is shut down if this started it."""
    check_ray(scale)
    import ray

    from k3core.rl.resident import RAY_NAMESPACE, start_actors

    owns = not ray.is_initialized()
    if owns:
        common = dict(namespace=RAY_NAMESPACE, runtime_env={"env_vars": _worker_env()})
        if scale.ray_address:
            try:
                ray.init(address=scale.ray_address, **common)
            except ConnectionError as e:  # Ray never turns token auth on by itself for an explicit address
                raise ConnectionError(f"{e}; a head started by `ray start` authenticates drivers by token unless it "
                                      "was started with RAY_AUTH_MODE=disabled: run with RAY_AUTH_MODE=token and the "
                                      "cluster's token (~/.ray/auth_token, or RAY_AUTH_TOKEN)") from e
        else:  # one CPU of Ray's accounting per shard task; the engine actors hold none (k3core.rl.resident)
            common["runtime_env"]["env_vars"]["PYTHONPATH"] = _import_path()
            # address "local": a new instance, never one a `ray start` left registered on this machine
            ray.init(address="local", num_cpus=scale.rollout_workers, include_dashboard=False,
                     object_store_memory=RAY_OBJECT_STORE_BYTES, **common)
    actors = []
    try:
        actors = start_actors(run_id, scale.rollout_workers)
        ray.get([a.status.remote() for a in actors])  # every actor is up before the first shard
        yield actors
    finally:
        for a in actors:
            ray.kill(a)
        if owns:
            ray.shutdown()
