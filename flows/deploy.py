"""Deployments and schedules: the ``rl_continue`` flow (one more RL iteration of a named run, never two
at once), the deployments of ``prefect.yaml`` served in one process (``k3rl serve``) or registered on a
process work pool (``k3rl deploy`` + ``k3rl worker``).

``prefect.yaml`` at the repository root is the one definition of the deployments: ``k3rl deploy`` hands
it to ``prefect deploy --all``, and ``k3rl serve`` builds the same deployments from it with
``flow.to_deployment`` and serves them with ``prefect.serve`` (no work pool, no worker).

No-overlap contract of ``rl_continue``: a tick holds the run's lock (``flows/runlock.py``: an
exclusive, non-blocking ``flock`` on ``<artifacts>/runs/<run_id>/.lock``) for the whole iteration. A
tick that finds it held does nothing and ends ``Skipped`` (a Completed state) with one warning naming the lock. A file
lock rather than a Prefect global concurrency limit: it needs no server-side setup (a missing limit
is not created by ``concurrency(..., strict=False)``: it is just not enforced), it also holds for
``rl_continue`` called without a server, and a crashed holder releases it at once (a lease would
wait for its expiry).
"""

from __future__ import annotations

import copy

import json
import os
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.states import Completed

from flows.pipeline import rl_run
from flows.runlock import iterations_done, lock_path, run_lock  # noqa: F401 (public here too)
from k3core.settings import PipelineSettings, RLSettings

from flows.cli_deploy import DEFAULT_FILE, DEFAULT_POOL, PROJECT_ROOT  # noqa: F401 (public here too)
# Settings a continuation may change without changing what the finished iterations were.
# The device and the dtype are among them, and a tick takes the ones it is given: a run started on a
# GPU in bf16 continues on a CPU in fp32 (or back) from its artifacts (trainer states read in either
# dtype: tests/tasks/test_dtype.py).
_FREE_FIELDS = {("pipeline", "iterations"), ("pipeline", "run_id"), ("pipeline", "artifacts"), ("device", "type"),
                ("device", "dtype")}


# ----------------------------------------------------------------------------------------- continue
def resolve_settings(run_id: str, artifacts: str, settings: RLSettings | None) -> tuple[RLSettings, list[str]]:
    """The settings to continue ``run_id`` with, and warnings.

    A run's settings are recorded in ``runs/<id>/settings.json`` by its first ``rl_continue`` tick and
    win over later ones: finished stages are cached on their inputs, so continuing with, say, another
    rollout batch size would recompute (not continue) the run. ``settings`` only start a run that has
    no record (including a run started by ``rl_run`` directly), except for the device: a tick computes
    on the device its ``settings`` name (the machine it runs on), not the one recorded."""
    from k3core.artifacts import ArtifactStore
    from k3core.rl.layout import RunLayout

    store = ArtifactStore(artifacts)
    rel = RunLayout(run_id).settings
    given = (settings or RLSettings()).replace(run_id=run_id, artifacts=artifacts)
    if not store.exists(rel):
        store.write_text(rel, json.dumps(given.to_dict(), indent=2))
        return given, []
    recorded = RLSettings.from_dict(json.loads(store.read_text(rel))).replace(run_id=run_id, artifacts=artifacts)
    warnings = []
    if settings is not None:
        ours, theirs = given.to_dict(), recorded.to_dict()
        diff = {f"{sec}.{k}": (v, theirs[sec][k]) for sec, fields in ours.items() for k, v in fields.items()
                if (sec, k) not in _FREE_FIELDS and v != theirs[sec][k]}
        if diff:
            warnings.append(f"run '{run_id}' continues with its recorded settings ({rel}); ignoring given "
                            + ", ".join(f"{k}={a!r} (recorded {b!r})" for k, (a, b) in diff.items()))
        recorded = recorded.replace(device=given.device.type)
    return recorded, warnings


@flow(name="rl_continue", log_prints=True)
def rl_continue(run_id: str = "demo", artifacts: str = "./artifacts", iterations_per_tick: int = 1,
                settings: RLSettings | None = None):
    """Continue run ``run_id`` by ``iterations_per_tick`` RL iterations: read how many are done from
    ``latest.json``, then ``rl_run`` with ``iterations = done + iterations_per_tick`` and the same run id
    (cached stages are skipped). A tick that finds the run busy ends Skipped (Completed) without doing anything.
    Returns ``rl_run``'s summary."""
    log = get_run_logger()
    if iterations_per_tick < 1:
        raise ValueError(f"iterations_per_tick must be >= 1, got {iterations_per_tick}")
    PipelineSettings(run_id=run_id, artifacts=artifacts)  # a run id that is a path is refused before the lock
    with run_lock(artifacts, run_id) as held:
        if not held:
            msg = (f"run '{run_id}' is busy (pid {held.holder or '?'} holds {held.path}: another tick or a `k3rl run`); "
                   "skipping this tick")
            log.warning(msg)
            # a Completed state named Skipped: a returned Cancelled state makes Prefect's runner log a
            # CancelledRun traceback for a tick that did nothing wrong
            return Completed(name="Skipped", message=msg)
        if held.took_over_from:
            log.warning(f"run '{run_id}': took over {held.path} from pid {held.took_over_from}, which died holding it")
        s, warnings = resolve_settings(run_id, artifacts, settings)
        for w in warnings:
            log.warning(w)
        done = iterations_done(artifacts, run_id)
        target = done + iterations_per_tick
        log.info(f"run '{run_id}': {done} iterations done, continuing to {target}")
        summary = rl_run(s.replace(iterations=target))
        from prefect.artifacts import create_markdown_artifact

        from flows.reports import artifact_key, tick_markdown

        # the reports sit on the rl_run subflow: the tick's own flow run links to them
        create_markdown_artifact(tick_markdown(run_id, summary), key=artifact_key("tick", run_id),
                                 description=f"run {run_id}: this tick, and links to the run's reports")
        return summary


# -------------------------------------------------------------------------------------- deployments
def load_config(path: str | os.PathLike = DEFAULT_FILE) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def _schedule(spec: dict):
    """One ``schedules:`` entry of prefect.yaml (``interval`` seconds or ``cron``) as a Prefect Schedule."""
    from prefect.schedules import Cron, Interval

    common = {k: spec[k] for k in ("timezone", "active", "parameters", "slug") if k in spec}
    if "interval" in spec:
        anchor = spec.get("anchor_date")
        if isinstance(anchor, str):
            from datetime import datetime

            anchor = datetime.fromisoformat(anchor)
        return Interval(float(spec["interval"]), anchor_date=anchor, **common)
    if "cron" in spec:
        return Cron(spec["cron"], day_or=spec.get("day_or", True), **common)
    raise ValueError(f"schedule {spec} has neither 'interval' nor 'cron' (k3rl serve supports those two)")


def _concurrency(spec):
    """prefect.yaml's ``concurrency_limit`` (an int, or ``{limit, collision_strategy}``) as ``prefect
    deploy`` reads it."""
    if spec is None or isinstance(spec, int):
        return spec
    from prefect.client.schemas.objects import ConcurrencyLimitConfig

    return ConcurrencyLimitConfig(**spec)


def with_overrides(d: dict, preset: str | None = None, interval: float | None = None) -> dict:
    """A deployment of prefect.yaml with ``k3rl serve``'s overrides: ``preset`` (its settings' model
    preset, and a seeded ``init:`` source re-seeded for that preset) and ``interval`` (seconds, every
    schedule). Trying the tiny preset, or a faster schedule, needs no edit of the file."""
    d = copy.deepcopy(d)
    settings = (d.get("parameters") or {}).get("settings")
    if preset is not None and isinstance(settings, dict):
        model = settings.setdefault("model", {})
        model["preset"] = preset
        source = model.get("source")
        if isinstance(source, str) and source.startswith("init:"):
            seed = source.split(":")[2] if source.count(":") >= 2 else "0"
            model["source"] = f"init:{preset}:{seed}"
    if interval is not None:
        if not interval > 0:
            raise ValueError(f"--interval {interval}: a schedule's interval is a positive number of seconds")
        for s in d.get("schedules") or []:
            s.pop("cron", None)
            s["interval"] = interval
    return d


def runner_deployments(path: str | os.PathLike = DEFAULT_FILE, names: list[str] | None = None,
                       preset: str | None = None, interval: float | None = None) -> list:
    """The deployments of a prefect.yaml as RunnerDeployments for ``prefect.serve`` (entrypoints are
    relative to the file's directory), with ``with_overrides``' ``preset`` and ``interval``."""
    from prefect.flows import load_flow_from_entrypoint

    path = Path(path).resolve()
    out = []
    for d in load_config(path)["deployments"]:
        if names and d["name"] not in names:
            continue
        d = with_overrides(d, preset, interval)
        file, fn = d["entrypoint"].rsplit(":", 1)
        fl = load_flow_from_entrypoint(f"{path.parent / file}:{fn}")
        out.append(fl.to_deployment(
            name=d["name"], parameters=d.get("parameters") or {}, description=d.get("description"),
            tags=d.get("tags"), version=d.get("version"), concurrency_limit=_concurrency(d.get("concurrency_limit")),
            schedules=[_schedule(s) for s in d.get("schedules") or []] or None))
    if names and len(out) != len(names):
        raise ValueError(f"deployments {names} not all in {path}")
    return out
