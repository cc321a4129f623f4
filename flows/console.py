"""What ``k3rl run`` shows on a terminal besides Prefect's log lines: one progress bar of the run's
iterations and one line for the stage in flight (with a bar of its steps when the stage reports them,
as the warm-up does), fed by ``tasks.common.progress_event``.

Owns: whether the bar is drawn and how. Does not own: the events (stages and ``rl_run`` send them)
or the log lines (Prefect's logging configuration).

The bar is drawn only when stderr is a terminal (and ``TERM`` is not ``dumb``). Into a file, a pipe
or CI the bar is replaced by a heartbeat (``stage_heartbeat``): a line naming the stage in flight
each time it has run another ``every_s`` seconds, so a long stage is never a silent gap in the log. Prefect prints its log lines
through a rich ``Console`` of its own handler (``PrefectConsoleHandler``, on the root logger); the
bar is drawn through that same console, so a log line appears above the bar instead of tearing it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

__all__ = ["BAR_CHARACTER", "progress_wanted", "run_progress", "stage_heartbeat"]

BAR_CHARACTER = "\u2501"  # rich draws its bars with this character (tests look for it)


def progress_wanted(stream: IO | None = None) -> bool:
    """Whether a progress bar belongs on ``stream`` (default stderr): only an interactive terminal."""
    stream = stream or sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream is no terminal
        return False
    return tty and os.environ.get("TERM", "") != "dumb"


def _rich_log_handlers() -> list[logging.Handler]:
    """Handlers that print through a rich Console (Prefect's console handler), on any logger."""
    from rich.console import Console

    loggers = [logging.root] + [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    seen: dict[int, logging.Handler] = {}
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(getattr(h, "console", None), Console):
                seen[id(h)] = h
    return list(seen.values())


@contextlib.contextmanager
def run_progress(enabled: bool) -> Iterator[None]:
    """Draw the run's progress while the block runs (nothing when ``enabled`` is False)."""
    if not enabled:
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.theme import Theme

    from tasks.common import add_progress_listener, remove_progress_listener

    handlers = _rich_log_handlers()
    on_stderr = [h for h in handlers if getattr(h.console, "file", None) is sys.stderr]
    console = on_stderr[0].console if on_stderr else Console(file=sys.stderr)
    saved = {h: h.console for h in on_stderr}
    # Prefect's console carries only its own log styles (``inherit=False``); the bar needs rich's
    # defaults (``bar.back``, ...): pushed on top for the bar's lifetime (no name is shared)
    console.push_theme(Theme())
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, refresh_per_second=4)
    iterations = progress.add_task("iterations", total=None)
    stage = [progress.add_task("", total=None, visible=False)]

    def on_event(kind: str, info: dict) -> None:
        if kind == "iterations":
            progress.update(iterations, completed=info["done"], total=info["total"])
        elif kind == "stage_start":  # a new row: a stage has no step count until it reports one
            progress.remove_task(stage[0])
            stage[0] = progress.add_task(f"  {info['name']}", total=None)
        elif kind == "stage_step":
            progress.update(stage[0], completed=info["done"], total=info["total"])
        elif kind == "stage_end":
            progress.update(stage[0], visible=False)
        progress.refresh()  # drawn now, not at the next tick: events are few, and a stage may be short

    for h in on_stderr:
        h.console = console  # one console for log lines and bar (already the same object for the first)
    add_progress_listener(on_event)
    progress.start()
    try:
        yield
    finally:
        remove_progress_listener(on_event)
        progress.update(stage[0], visible=False)
        progress.stop()
        console.pop_theme()
        for h, c in saved.items():
            h.console = c


@contextlib.contextmanager
def stage_heartbeat(enabled: bool, every_s: float = 30.0, stream: IO | None = None) -> Iterator[None]:
    """While the block runs, write ``k3rl: <stage> in flight for N s`` to ``stream`` (default stderr)
    each time the stage in flight has run another ``every_s`` seconds (nothing when ``enabled`` is
    False). Stages shorter than ``every_s`` add no line: Prefect's ``Finished`` lines cover them."""
    if not enabled:
        yield
        return
    from tasks.common import add_progress_listener, remove_progress_listener

    current: list = [None, 0.0]  # [stage name, its start on the monotonic clock]
    lock = threading.Lock()
    stop = threading.Event()

    def on_event(kind: str, info: dict) -> None:
        with lock:
            if kind == "stage_start":
                current[:] = [info["name"], time.monotonic()]
            elif kind == "stage_end" and current[0] == info["name"]:
                current[:] = [None, 0.0]

    def beat() -> None:
        told: tuple = (None, 0)  # (stage, beats written for it)
        while not stop.wait(min(1.0, every_s / 4)):
            with lock:
                name, start = current
            if name is None:
                continue
            beats = int((time.monotonic() - start) // every_s)
            if beats > (told[1] if told[0] == (name, start) else 0):
                told = ((name, start), beats)
                print(f"k3rl: {name} in flight for {beats * every_s:g} s", file=stream or sys.stderr, flush=True)

    add_progress_listener(on_event)
    thread = threading.Thread(target=beat, name="k3rl-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        remove_progress_listener(on_event)
