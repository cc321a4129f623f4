"""A live engine served over HTTP on 127.0.0.1 for the length of a ``with`` block: the rollout server's
app (``k3core.rollout.server.create_app``: ``/v1/chat/completions``, sessions, ``/generate``) on a
free loopback port, run by uvicorn on a thread of this process, so that an agent harness talking
plain OpenAI chat (``k3core.rl.harness``) reaches the embedded engine a run already holds, with no
second copy of the weights.

While served, the engine's own driver thread decodes (the app's lifespan starts it); on exit the
server stops, the driver with it, and the engine is reopened (``RolloutEngine.reopen``) for the
stages that call ``generate`` directly.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

__all__ = ["served"]


@contextmanager
def served(engine, tokenizer, *, api_key: str | None = None, ready_timeout: float = 30.0):
    """Yield the base URL (``http://127.0.0.1:PORT``) of ``engine`` served with ``tokenizer``'s chat
    template; ``api_key``: required of every request but ``/health`` when set."""
    import uvicorn

    from k3core.rollout.server import create_app

    app = create_app(engine, tokenizer, api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    failed: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            failed.append(e)

    thread = threading.Thread(target=run, name="k3-local-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout
    while not server.started:
        if failed or not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(5)
            raise RuntimeError(f"the in-process rollout server did not start within {ready_timeout} s"
                               + (f": {type(failed[0]).__name__}: {failed[0]}" if failed else ""))
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        engine.reopen()
