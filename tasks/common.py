"""What every stage shares: retries with backoff, resume-friendly caching, asset lineage, naming.

- Retries: 2 with exponential backoff, except for errors retrying cannot fix (bad input, validation
  failures, an environment returning NaN): those fail at once with their message.
- Caching: ``INPUTS + TASK_SOURCE`` with persisted results under ``<artifact root>/.prefect-results``
  (not keyed on the flow run id), so a re-run of a run id skips every finished stage.
- Lineage: each stage runs as a Prefect ``MaterializingTask`` whose assets are the URIs it publishes
  and whose ``asset_deps`` are the URIs it read, so the Event Feed records checkpoint -> weights ->
  rollouts -> scores -> checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from prefect import Task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.tasks import MaterializingTask, exponential_backoff

from k3core.checkpoint.validate import CheckpointValidationError

NON_RETRYABLE = (ValueError, TypeError, KeyError, NotImplementedError, FileNotFoundError, CheckpointValidationError)
RETRIES = int(os.environ.get("K3RL_TASK_RETRIES", "2"))


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry transient failures only."""
    try:
        state.result()
    except NON_RETRYABLE:
        return False
    except Exception:
        return True
    return True


def stage_options(result_root: str | None) -> dict[str, Any]:
    opts: dict[str, Any] = dict(
        retries=RETRIES,
        retry_delay_seconds=exponential_backoff(backoff_factor=1),
        retry_jitter_factor=0.5,
        retry_condition_fn=retry_unless_bad_input,
        cache_policy=INPUTS + TASK_SOURCE,
        persist_result=True,
    )
    if result_root is not None:
        opts["result_storage"] = Path(result_root)
    return opts


def result_root_for(artifact_root: str) -> str | None:
    """Prefect result storage: beside local artifacts; Prefect's default for remote roots."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, base = fsspec.core.url_to_fs(artifact_root)
    if isinstance(fs, LocalFileSystem):
        p = Path(os.path.abspath(base)) / ".prefect-results"
        p.mkdir(parents=True, exist_ok=True)
        return str(p)
    return None


def stage(fn: Callable, *, name: str, artifact_root: str, outputs: list[str], inputs: list[str] = (),
          **extra: Any) -> Task:
    """Wrap a stage body as a task named ``name`` (e.g. ``rollout-iter3``) that materializes the
    asset URIs ``outputs`` from ``inputs``."""
    opts = stage_options(result_root_for(artifact_root))
    opts.update(extra)
    opts.setdefault("task_run_name", name)
    opts.setdefault("name", name.split("-iter")[0])
    return MaterializingTask(fn=fn, assets=list(outputs), asset_deps=list(inputs) or None, **opts)
