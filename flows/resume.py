"""What ``k3rl run`` does, holding the run's lock, before it starts (or resumes) the flow, so that a
previous process of the same run killed at any point (kill -9, OOM, power) leaves nothing behind.

Owns:
- the embedded Prefect server's lifetime. Prefect starts it as a child process (``python -m uvicorn``,
  ``prefect.server.api.server.SubprocessASGIServer``) and stops it from ``atexit``, which a SIGKILL
  never runs: the server then outlives its parent, listening, holding its memory and database.
  ``start_embedded_server`` starts it here, from the main thread, with ``PR_SET_PDEATHSIG`` set in the
  child between fork and exec: the kernel kills the server the moment this process dies, however it
  dies, with nothing left to sweep on the next run (a pid recorded for a later sweep would leave the
  orphan running until a resume that may never come, and could name a recycled pid).
- the staging paths (``.tmp-*``) of the run's dead writers (``ArtifactStore.remove_dead_staging``).
- flow runs of the run left ``Running`` (or ``Pending``) by a killed process: set ``Crashed``, with
  their unfinished task runs. They are found by ``run_tag``, which only ``k3rl run`` puts on its flow
  runs, and only while it holds the run's lock; a process holding that lock therefore knows any
  other unfinished flow run with the tag belongs to a process that is gone.

Does not own: the lock (``flows.runlock``), the resume itself (the stages' cache and published
artifacts, ``flows.pipeline``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1
_UNFINISHED = ("RUNNING", "PENDING", "SCHEDULED", "PAUSED", "CANCELLING")


def run_tag(lock: Path) -> str:
    """The tag of the flow runs a ``k3rl run`` makes under the lock file ``lock``: the run id, and a
    digest of this host and the lock's path (one run id under two artifact roots, or on two machines
    sharing a Prefect server, are two runs)."""
    digest = hashlib.sha256(f"{socket.gethostname()}:{lock.resolve()}".encode()).hexdigest()[:12]
    return f"k3rl-run:{lock.parent.name}:{digest}"


def remove_dead_staging(artifacts: str, run_id: str) -> list[Path]:
    from k3core.artifacts import ArtifactStore
    from k3core.rl.layout import RunLayout

    return ArtifactStore(artifacts).remove_dead_staging(RunLayout(run_id).rel())


def _pdeathsig_preexec():
    """A ``preexec_fn`` (runs in the child after fork, before exec): SIGKILL the child when its parent
    dies. libc is loaded here, in the parent, because the child must not import or allocate."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def bind() -> None:
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(126)

    return bind


def check_prefect_environment() -> None:
    """Refuse, naming the variable and the fix, a Prefect setting that would fail only once the run
    talks to Prefect (after minutes of retries and tracebacks): a ``PREFECT_API_URL`` whose server does
    not answer its health check, a ``PREFECT_HOME`` that is not a directory this user can write.
    ``ValueError``: one ``k3rl: error:`` line, exit 2."""
    import urllib.error
    import urllib.request

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    home = Path(str(PREFECT_HOME.value())).expanduser()
    named = "PREFECT_HOME" + (f"={os.environ['PREFECT_HOME']}" if "PREFECT_HOME" in os.environ else f" ({home})")
    try:
        home.mkdir(parents=True, exist_ok=True)
        probe = home / f".k3rl-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{named} is not a directory k3rl can write ({e.strerror or e}): point PREFECT_HOME at "
                         "one, or unset it (Prefect's default is ~/.prefect)") from None
    url = PREFECT_API_URL.value()
    if not url:
        return
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=10) as r:
            if r.status == 200:
                return
            why = f"its health check answered HTTP {r.status}"
    except urllib.error.HTTPError as e:
        why = f"its health check answered HTTP {e.code}"
    except (OSError, ValueError) as e:  # refused, unreachable, timed out; a malformed URL
        why = f"{getattr(e, 'reason', None) or e}"
    raise ValueError(f"PREFECT_API_URL={url} does not answer ({why}): start that Prefect server (prefect server "
                     "start), or unset PREFECT_API_URL to run on an embedded one")


def start_embedded_server() -> Any | None:
    """Start Prefect's embedded server as a child that dies with this process, and make it the one
    Prefect's clients use (the server registered for ``port=None``). None when ``PREFECT_API_URL``
    names a server (nothing embedded) or the embedded server is already running. Call it from the
    main thread: the kernel signals the child when the thread that forked it ends."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None  # a server of the user's, or none allowed: as Prefect's own client decides
    current = SubprocessASGIServer._instances.get(None)
    if current is not None and current.running:
        return None

    class DiesWithParent(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            preexec = _pdeathsig_preexec()
            real = subprocess.Popen

            def popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
                # a session of its own: a Ctrl-C in the terminal reaches this process, which stops the run
                # and then the server, not the server first (the run would then fail on its connection)
                kwargs.setdefault("start_new_session", True)
                return real(*args, preexec_fn=preexec, **kwargs)

            # Prefect's method makes one Popen call and takes no preexec_fn, so the module attribute
            # is swapped for its duration; the CLI starts no other process meanwhile (no flow runs yet)
            subprocess.Popen = popen
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = real

    SubprocessASGIServer._instances.pop(None, None)
    server = DiesWithParent()  # registers itself under port=None: Prefect's get_client() finds it
    server.start()
    return server


def crash_stale_flow_runs(tag: str) -> list[str]:
    """Set ``Crashed`` on every unfinished flow run tagged ``tag`` and on their unfinished task runs;
    their names. Call it holding the run's lock and before starting a flow run with the tag."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, FlowRunFilterState,
                                                FlowRunFilterStateType, FlowRunFilterTags, TaskRunFilter,
                                                TaskRunFilterState, TaskRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    unfinished = [StateType(s) for s in _UNFINISHED]
    message = ("the process running this flow run died without finishing it (killed); a later `k3rl run` "
               "of the same run holds its lock and resumes it")
    names = []
    with get_client(sync_client=True) as client:
        stale = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[tag]), state=FlowRunFilterState(type=FlowRunFilterStateType(any_=unfinished))))
        if not stale:
            return names
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in stale])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=unfinished))))
        for t in tasks:
            client.set_task_run_state(t.id, Crashed(message=message), force=True)
        for r in stale:
            client.set_flow_run_state(r.id, Crashed(message=message), force=True)
            names.append(r.name)
    return names
