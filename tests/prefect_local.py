"""A real ``prefect server start`` on 127.0.0.1 for tests: a free port, its own PREFECT_HOME (so its
SQLite database, ``<home>/prefect.db``, is the test's to read), started in a session of its own and
stopped with every child it spawned."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy after {timeout} s")


def stop(proc: subprocess.Popen | None, grace: float) -> None:
    """Stop a process started in its own session, with every child (the server's services, the
    runner's flow-run processes): SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    if grace > 0:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


class PrefectServer:
    """``prefect server start`` in ``home`` (UI off); ``api`` is its API URL, ``env`` the environment
    a client process reports to it with."""

    def __init__(self, home: Path, **settings: str):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_API_URL=self.api,
                        PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_UI_ENABLED="false",
                        **settings)
        self.log = self.home / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> PrefectServer:
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                          "--port", str(self.port)], env=self.env, cwd=self.home,
                                         start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.api, self.proc, timeout)
        except Exception:
            self.stop()
            raise RuntimeError(f"the test Prefect server did not start:\n{self.log.read_text()[-3000:]}") from None
        return self

    def stop(self) -> None:
        stop(self.proc, grace=15)
