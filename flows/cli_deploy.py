"""The deployment subcommands of the ``k3rl`` CLI: ``serve``, ``deploy``, ``worker`` (the flows and
deployments they act on are in ``flows/deploy.py``). Registering them imports nothing heavy, so that
parsing ``k3rl --help`` and refusing bad input never pay for importing Prefect or torch; each command
imports what it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = PROJECT_ROOT / "prefect.yaml"
DEFAULT_POOL = "k3rl-local"


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

    from flows.deploy import runner_deployments

    _need_server()
    path = Path(a.file).resolve()
    os.chdir(path.parent)  # entrypoints and relative artifact roots are relative to the project
    deps = runner_deployments(path, a.name or None, preset=a.preset, interval=a.interval)
    print(f"k3rl: serving {', '.join(d.name for d in deps)} from {path} (Ctrl-C stops)", flush=True)
    serve(*deps, limit=a.limit)
    return 0


def cmd_deploy(a) -> int:
    """Create the process work pools prefect.yaml names if missing, then ``prefect deploy`` on it."""
    from flows.deploy import load_config

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
    from k3core.config import PRESETS  # no torch: the config module is plain dataclasses
    s = sub.add_parser("serve", help="serve the deployments of prefect.yaml (schedules included) in this process",
                       epilog="example: PREFECT_API_URL=http://127.0.0.1:4200/api k3rl serve")
    s.add_argument("--file", default=str(DEFAULT_FILE), help="a prefect.yaml (default: the repository's)")
    s.add_argument("--name", action="append", help="only this deployment (repeatable)")
    s.add_argument("--limit", type=int, default=None, help="at most this many flow runs at once")
    s.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="the model preset of every deployment's settings (an init: source follows it), instead of the file's")
    s.add_argument("--interval", type=float, default=None, metavar="SECONDS",
                   help="every schedule's interval in seconds, instead of the file's")
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
