"""The task runner of a run's iteration flows (``--task-runner``): where rollout shards run.

- ``local``: Prefect's default runner; every stage runs in the flow's process.
- ``dask``: prefect-dask's ``DaskTaskRunner`` on one Dask cluster for the whole run: a
  ``LocalCluster`` of ``--rollout-workers`` single-threaded worker processes on this machine
  (loopback), or the scheduler at ``--dask-address``. The cluster outlives each iteration's flow,
  so every worker keeps its rollout engine resident across iterations (the worker plugin of
  ``tasks.engines``); each iteration flow joins it with a runner of its own.

Workers import ``tasks`` and ``k3core`` from their own Python path: on a cluster started elsewhere,
the same checkout or package must be installed on every worker, and the artifact root must be a
location every worker and the flow can read and write (a shared filesystem or an fsspec URL).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from k3core.settings import ScaleOutSettings

__all__ = ["check_dask", "iteration_runner"]


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
        import socket
        from urllib.parse import urlsplit

        u = urlsplit(scale.dask_address)
        try:
            with socket.create_connection((u.hostname, u.port), timeout=timeout):
                pass
        except (OSError, TypeError, ValueError) as e:
            raise ValueError(f"--dask-address {scale.dask_address}: no Dask scheduler answers there ({e}); start one "
                             "(`dask scheduler`, then `dask worker ADDRESS --nthreads 1`) or leave --dask-address out "
                             "for a LocalCluster on this machine") from None


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
def iteration_runner(scale: ScaleOutSettings) -> Iterator[Callable[[], object] | None]:
    """For the length of a run: ``None`` (local), or a factory of ``DaskTaskRunner`` for each
    iteration flow, joined to the run's cluster with the engine worker plugin registered."""
    if scale.task_runner != "dask":
        yield None
        return
    check_dask(scale)
    from distributed import Client, LocalCluster
    from prefect_dask import DaskTaskRunner

    from tasks.engines import worker_plugin

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
        client.register_plugin(worker_plugin(), name="k3rl-engines")
        yield lambda: DaskTaskRunner(address=address)
