"""How ``k3rl run`` ends on SIGTERM (schedulers, containers, ``kill``) and SIGINT (Ctrl-C): promptly,
resumably, with one line naming how to resume.

The first signal stops the run where Python handles it, the main thread: SIGTERM raises
``TerminationSignal`` (``stop_guard`` installs a handler that does what Prefect's engine does inside
a flow, since between subflows the default action would kill the process without a word; SIGINT
raises ``KeyboardInterrupt``), the flow engine marks the task and flow runs Crashed, and the
exception reaches the CLI, which prints the resume line and exits 143 (130). Two
things can keep that from ending the process, and ``stop_guard`` covers both: a second signal that
lands inside the engine's own crash handling (``timeout``, ``srun`` and process-group kills send
one to every process, and a user presses Ctrl-C twice) raises again there and can leave the process
asleep; and a stage that does not return to Python soon. The guard watches every signal through
``signal.set_wakeup_fd``, which the interpreter writes to whatever handler is installed: a second
SIGTERM or SIGINT, or a run still alive ``grace`` seconds after the first, ends the process at once
(``os._exit``) with the same resume line and exit status. Nothing half-written is published either
way: every artifact is staged and renamed, and the run's lock passes to the next process that finds
its holder dead (``flows.runlock``), so the same command resumes.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator

STOPS = {signal.SIGTERM: 143, signal.SIGINT: 130}  # the exit status of a run stopped by each


def resume_line(run_id: str, sig: int) -> str:
    return (f"k3rl: stopped by {signal.Signals(sig).name}; run '{run_id}' is resumable: run the same command again "
            "(finished stages are kept, nothing half-written was published)")


@contextlib.contextmanager
def stop_guard(run_id: str, grace: float = 60.0) -> Iterator[dict]:
    """Within the block (from the main thread), a second SIGTERM/SIGINT or ``grace`` seconds after the
    first end the process at once with the resume line. Yields a dict whose ``"signal"`` is the first
    stop signal seen (the CLI's exit status when the block ends by it)."""
    from prefect.exceptions import TerminationSignal

    seen: dict = {}
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: nothing to watch
        os.close(r)
        os.close(w)
        yield seen
        return

    def terminate(sig: int, _frame) -> None:
        raise TerminationSignal(sig)

    # Prefect's engine raises TerminationSignal only while its own handler is installed, and between
    # (sub)flows the default handler would kill the process without a word: ours raises the same
    # exception everywhere in the block, and Prefect's engine restores it when it hands back
    old_term = signal.signal(signal.SIGTERM, terminate)
    done = threading.Event()

    def stop_now(sig: int, why: str) -> None:
        print(f"k3rl: {why}: exiting now\n{resume_line(run_id, sig)}", file=sys.stderr, flush=True)
        os._exit(STOPS[sig])

    def watch() -> None:
        first_at = None
        while not done.is_set():
            wait = 0.5 if first_at is None else max(0.0, min(0.5, first_at + grace - time.monotonic()))
            if select.select([r], [], [], wait)[0]:
                for sig in os.read(r, 64):
                    if sig not in STOPS:
                        continue
                    if first_at is None:
                        first_at, seen["signal"] = time.monotonic(), sig
                    else:
                        stop_now(sig, f"a second {signal.Signals(sig).name}")
            if first_at is not None and time.monotonic() > first_at + grace and not done.is_set():
                stop_now(seen["signal"], f"still running {grace:g} s after {signal.Signals(seen['signal']).name}")

    thread = threading.Thread(target=watch, name="k3rl-stop-guard", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        signal.signal(signal.SIGTERM, old_term)
        signal.set_wakeup_fd(old)
        thread.join(timeout=2)
        os.close(r)
        os.close(w)
