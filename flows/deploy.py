"""Deployments and schedules: the ``rl_continue`` flow (one more RL iteration of a named run, never two
at once), the deployments of ``prefect.yaml`` served in one process (``k3rl serve``) or registered on a
process work pool (``k3rl deploy`` + ``k3rl worker``).

``prefect.yaml`` at the repository root is the one definition of the deployments: ``k3rl deploy`` hands
it to ``prefect deploy --all``, and ``k3rl serve`` builds the same deployments from it with
``flow.to_deployment`` and serves them with ``prefect.serve`` (no work pool, no worker).

No-overlap contract of ``rl_continue``: a tick holds the run's lock (``flows/runlock.py``: an
exclusive, non-blocking ``flock`` on ``<artifacts>/runs/<run_id>/.lock``) for the whole iteration. A
tick that finds it held does nothing and ends ``Cancelled`` with a log line naming the lock. A file
lock rather than a Prefect global concurrency limit: it needs no server-side setup (a missing limit
is not created by ``concurrency(..., strict=False)``: it is just not enforced), it also holds for
``rl_continue`` called without a server, and a crashed holder releases it at once (a lease would
wait for its expiry).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.states import Cancelled

from flows.pipeline import rl_run
from flows.runlock import iterations_done, lock_path, run_lock  # noqa: F401 (public here too)
from k3core.settings import PipelineSettings, RLSettings

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = PROJECT_ROOT / "prefect.yaml"
DEFAULT_POOL = "k3rl-local"
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

    store = ArtifactStore(artifacts)
    rel = f"runs/{run_id}/settings.json"
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
    (cached stages are skipped). A tick that finds the run busy ends Cancelled without doing anything.
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
            return Cancelled(message=msg)
        if held.took_over_from:
            log.warning(f"run '{run_id}': took over {held.path} from pid {held.took_over_from}, which died holding it")
        s, warnings = resolve_settings(run_id, artifacts, settings)
        for w in warnings:
            log.warning(w)
        done = iterations_done(artifacts, run_id)
        target = done + iterations_per_tick
        log.info(f"run '{run_id}': {done} iterations done, continuing to {target}")
        return rl_run(s.replace(iterations=target))


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


def runner_deployments(path: str | os.PathLike = DEFAULT_FILE, names: list[str] | None = None) -> list:
    """The deployments of a prefect.yaml as RunnerDeployments for ``prefect.serve`` (entrypoints are
    relative to the file's directory)."""
    from prefect.flows import load_flow_from_entrypoint

    path = Path(path).resolve()
    out = []
    for d in load_config(path)["deployments"]:
        if names and d["name"] not in names:
            continue
        file, fn = d["entrypoint"].rsplit(":", 1)
        fl = load_flow_from_entrypoint(f"{path.parent / file}:{fn}")
        out.append(fl.to_deployment(
            name=d["name"], parameters=d.get("parameters") or {}, description=d.get("description"),
            tags=d.get("tags"), version=d.get("version"), concurrency_limit=_concurrency(d.get("concurrency_limit")),
            schedules=[_schedule(s) for s in d.get("schedules") or []] or None))
    if names and len(out) != len(names):
        raise ValueError(f"deployments {names} not all in {path}")
    return out


# ---------------------------------------------------------------------------------------------- CLI
def _need_server() -> None:
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise ValueError("no Prefect server: start one (`prefect server start`) and "
                         "`export PREFECT_API_URL=http://127.0.0.1:4200/api` (deployments and schedules "
                         "live in the server's database)")


def _prefect_cmd(*args: str) -> list[str]:
    """The ``prefect`` CLI of this environment (beside this Python), whatever PATH says."""
    return [sys.executable, "-m", "prefect", *args]


def _prefect(*args: str, quiet: bool = False, cwd: Path | None = None) -> int:
    return subprocess.run(_prefect_cmd(*args), cwd=cwd, text=True, capture_output=quiet).returncode


def cmd_serve(a) -> int:
    """All (or the named) deployments of prefect.yaml in this process, until interrupted."""
    from prefect import serve

    _need_server()
    path = Path(a.file).resolve()
    os.chdir(path.parent)  # entrypoints and relative artifact roots are relative to the project
    deps = runner_deployments(path, a.name or None)
    print(f"k3rl: serving {', '.join(d.name for d in deps)} from {path} (Ctrl-C stops)", flush=True)
    serve(*deps, limit=a.limit)
    return 0


def cmd_deploy(a) -> int:
    """Create the process work pools prefect.yaml names if missing, then ``prefect deploy`` on it."""
    _need_server()
    path = Path(a.file).resolve()
    deployments = [d for d in load_config(path)["deployments"] if not a.name or d["name"] in a.name]
    for pool in sorted({(d.get("work_pool") or {}).get("name") or DEFAULT_POOL for d in deployments}):
        if _prefect("work-pool", "inspect", pool, quiet=True) != 0:
            print(f"k3rl: creating process work pool '{pool}'", flush=True)
            if rc := _prefect("work-pool", "create", pool, "--type", "process"):
                print(f"k3rl: error: could not create work pool '{pool}'", file=sys.stderr)
                return rc
    args = ["--no-prompt", "deploy", "--prefect-file", str(path)]
    args += [x for n in a.name for x in ("--name", n)] if a.name else ["--all"]
    if rc := _prefect(*args, cwd=path.parent):
        print(f"k3rl: error: `prefect deploy` failed (exit {rc})", file=sys.stderr)
        return rc
    print("k3rl: deployments registered; start a worker with `k3rl worker`", flush=True)
    return 0


def cmd_worker(a) -> int:
    """A process worker on the pool (runs deployment runs as local subprocesses), until interrupted."""
    _need_server()
    args = ["worker", "start", "--pool", a.pool, "--type", "process"]
    if a.limit:
        args += ["--limit", str(a.limit)]
    os.chdir(PROJECT_ROOT)
    sys.stdout.flush()
    os.execv(sys.executable, _prefect_cmd(*args))  # become the worker: signals reach it directly


def add_deploy_subcommands(sub) -> None:
    s = sub.add_parser("serve", help="serve the deployments of prefect.yaml (schedules included) in this process",
                       epilog="example: PREFECT_API_URL=http://127.0.0.1:4200/api k3rl serve")
    s.add_argument("--file", default=str(DEFAULT_FILE), help="a prefect.yaml (default: the repository's)")
    s.add_argument("--name", action="append", help="only this deployment (repeatable)")
    s.add_argument("--limit", type=int, default=None, help="at most this many flow runs at once")
    s.set_defaults(fn=cmd_serve)
    d = sub.add_parser("deploy", help="register the deployments of prefect.yaml (their process work pool is created if missing)",
                       epilog="example: PREFECT_API_URL=http://127.0.0.1:4200/api k3rl deploy && k3rl worker")
    d.add_argument("--file", default=str(DEFAULT_FILE), help="a prefect.yaml (default: the repository's)")
    d.add_argument("--name", action="append", help="only this deployment (repeatable; default all)")
    d.set_defaults(fn=cmd_deploy)
    w = sub.add_parser("worker", help="a process worker that runs the deployments registered by `k3rl deploy`",
                       epilog="example: PREFECT_API_URL=http://127.0.0.1:4200/api k3rl worker --pool k3rl-local")
    w.add_argument("--pool", default=DEFAULT_POOL, help=f"work pool to take flow runs from (default {DEFAULT_POOL})")
    w.add_argument("--limit", type=int, default=None, help="at most this many flow runs at once")
    w.set_defaults(fn=cmd_worker)
