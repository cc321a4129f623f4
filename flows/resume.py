"""What ``k3rl run`` does, holding the run's lock, before it starts (or resumes) the flow, so that a
previous process of the same run killed at any point (kill -9, OOM, power) leaves nothing behind.

Owns:
- the embedded Prefect server's lifetime (``EmbeddedServer``). Prefect's own embedded mode starts it
  as a child process (``python -m uvicorn``) and stops it from ``atexit``, which a SIGKILL never
  runs: the server then outlives its parent, listening, holding its memory and database. k3rl starts
  Prefect's server app itself, from the main thread, with ``PR_SET_PDEATHSIG`` set in the child
  between fork and exec: the kernel kills the server the moment this process dies, however it dies,
  with nothing left to sweep on the next run (a pid recorded for a later sweep would leave the
  orphan running until a resume that may never come, and could name a recycled pid). It starts
  before the run's heavy imports and is waited for after them.
- the staging paths (``.tmp-*``) of the run's dead writers (``ArtifactStore.remove_dead_staging``).
- flow runs of the run left ``Running`` (or ``Pending``) by a killed process: set ``Crashed``, with
  their unfinished task runs. They are found by ``run_tag``, which only ``k3rl run`` puts on its flow
  runs, and only while it holds the run's lock; a process holding that lock therefore knows any
  other unfinished flow run with the tag belongs to a process that is gone.

Does not own: the lock (``flows.runlock``), the resume itself (the stages' cache and published
artifacts, ``flows.pipeline``).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

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


def has_summary(s) -> bool:
    """Whether the run (``RLSettings``) has recorded a summary: it may be finished, and then only
    replays it (``flows.reports.finished_summary`` decides)."""
    from k3core.artifacts import ArtifactStore
    from k3core.rl.layout import RunLayout

    return ArtifactStore(s.pipeline.artifacts).exists(RunLayout(s.pipeline.run_id).summary)


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


EMBEDDED_LINE = "k3rl: Prefect's embedded server is up"  # what a run prints once its embedded server answers


class EmbeddedServer:
    """Prefect's own server app (``prefect.server.api.server:create_app``) under uvicorn, in a child
    process of this one, as Prefect's embedded mode runs it (UI off, ephemeral services), with
    ``PR_SET_PDEATHSIG`` set in the child between fork and exec. Started (``launch_embedded_server``)
    without waiting: the server imports Prefect's whole API (about 3 s of CPU) while this process imports the
    model and pipeline, on the other core; ``ready`` waits for its health check and makes it the API
    this process's Prefect clients use (``PREFECT_API_URL`` in a settings context held for the
    process's life). This process never imports the server's code. One per process, stopped from
    ``atexit`` after Prefect's own exit handlers have sent their last logs and events to it (they
    were registered later, and ``atexit`` runs last-registered first)."""

    APP = "prefect.server.api.server:create_app"
    TRIES = 3  # a port taken between choosing it and binding it: another port, as Prefect does

    def __init__(self) -> None:
        from prefect.settings import get_current_settings

        # the settings this process resolved (profile, environment) reach the server as variables
        self._env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
                     "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        self._settings = None
        # the server's own output, read back only when it fails to start: a server stopped while a
        # request is in flight logs a cancelled database call, which is not the run's to print
        self._output = tempfile.TemporaryFile()
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._spawn()
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _spawn(self) -> None:
        with socket.socket() as s:  # a free port now; the server binds it a moment later
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        # a session of its own: a Ctrl-C in the terminal reaches this process, which stops the run
        # and then the server, not the server first (the run would then fail on its connection)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", self.APP, "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env=self._env, preexec_fn=_pdeathsig_preexec(), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=self._output, stderr=subprocess.STDOUT)

    def _tail(self, n: int = 2000) -> str:
        self._output.seek(0)
        return self._output.read().decode(errors="replace")[-n:]

    def ready(self, timeout: float) -> EmbeddedServer:
        """Wait until the server answers its health check (spawning it again on another port if its
        port was taken), then point this process's Prefect clients at it. ``RuntimeError`` naming the
        exit status when it dies or does not answer within ``timeout`` seconds."""
        import time
        import urllib.error
        import urllib.request

        from prefect.settings import PREFECT_API_URL, temporary_settings

        deadline, tries = time.monotonic() + timeout, 1
        while True:
            code = self.proc.poll()
            if code is not None:
                if tries >= self.TRIES:
                    raise RuntimeError(f"Prefect's embedded server exited with status {code} on start ({tries} tries): "
                                       f"{self._tail()}\nSet PREFECT_API_URL to a running server to use that one")
                tries += 1
                self._spawn()
                continue
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Prefect's embedded server did not answer on {self.url} within {timeout:.0f} s "
                                   f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); its output: {self._tail()}")
            time.sleep(0.05)
        if self._settings is None:
            self._settings = temporary_settings(updates={PREFECT_API_URL: self.url})
            self._settings.__enter__()  # held for the process's life: Prefect's exit handlers use it too
            print(f"{EMBEDDED_LINE} on {self.url} (the UI, and flow runs that outlive the run: `prefect server "
                  "start` and PREFECT_API_URL)", file=sys.stderr, flush=True)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_embedded: EmbeddedServer | None = None


def launch_embedded_server() -> EmbeddedServer | None:
    """This process's embedded server, started (``EmbeddedServer``) if none is; None when
    ``PREFECT_API_URL`` names a server (nothing embedded) or Prefect's embedded mode is off. Call it
    from the main thread: the kernel signals the child when the thread that forked it ends."""
    global _embedded
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if _embedded is not None and _embedded.proc.poll() is None:
        return _embedded
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None  # a server of the user's, or none allowed: as Prefect's own client decides
    _embedded = EmbeddedServer()
    return _embedded


def start_embedded_server() -> EmbeddedServer | None:
    """``launch_embedded_server``, waited for: the run's Prefect clients talk to it from here on."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    server = launch_embedded_server()
    return server.ready(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()) if server else None


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
