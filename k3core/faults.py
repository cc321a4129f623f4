"""Fault injection for the kill -9 and full-disk tests: ``K3RL_FAULT=<stage>:<point>`` makes the
process SIGKILL itself at one named point of one stage, as a power cut or the OOM killer would, or
(``enospc``) makes that stage's write fail as on a full disk.

Owns: reading ``K3RL_FAULT`` (once, at import), the name of the stage running in this thread, the
kill and the injected ``OSError``. Does not own: where the points sit (``k3core.artifacts.ArtifactStore.publish`` calls
``reached("before-publish" | "mid-write")``, the stage wrapper of ``tasks.common`` calls
``reached("after-publish")``), nor checking what a resumed run does after the kill
(``tests/flows/test_kill_matrix.py``) or after a full disk (``tests/flows/test_disk_full.py``).

``<stage>``: a stage's task run name (``rollout-iter1``, ``save_checkpoint-iter0``, ``warmup``,
``evaluate-final``) or its timing key (``rollout``, ``save``: the first call of that stage).
``<point>``:

- ``mid-write``: the stage's artifact is half written in its staging path (``.tmp-*``): the marker
  absent and one file holding only the first half of its bytes, as a kill during the write leaves it;
- ``before-publish``: the staging path holds the whole artifact, fsynced, not yet renamed to its
  published name;
- ``after-publish``: the stage body returned (every artifact of it published, pointers such as
  ``latest.json`` updated), but Prefect has not recorded the task run as finished nor persisted its
  result. For stages that publish no file (``transfer``, ``evaluate``, ``mismatch``) this is the
  only point;
- ``enospc``: at ``mid-write`` the staging path is left half written as there, and the stage's write
  raises ``OSError(ENOSPC)`` naming that file instead of the process being killed: the stage fails as
  on a full disk, and its publish removes the staging path;
- ``sigterm``, ``sigint``: at the first of ``before-publish`` and ``after-publish`` the stage reaches,
  the process sends itself that signal once, as a scheduler or Ctrl-C would, and goes on: the signal
  is handled where Python handles it (the main thread), while a stage in another thread may still
  finish and publish (``flows.signals``).

``K3RL_FAULT_SCOPE=group`` makes a kill take the whole process group instead of the one process
(``os.killpg``), as a power cut would: a stage running in a scale-out worker (a Dask worker process,
started by the run and in its group) then takes the run and every other worker down with it.

Unset (always, outside these tests) ``SPEC`` is None: ``reached`` returns after one comparison and
stages run unwrapped.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import signal
from pathlib import Path
from collections.abc import Iterator

POINTS = ("before-publish", "mid-write", "after-publish", "enospc", "sigterm", "sigint")
_SIGNALS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
_signalled: list[str] = []  # a stop signal is sent once per process


def parse(text: str | None) -> tuple[str, str] | None:
    """``"<stage>:<point>"`` -> (stage, point); None for an unset or empty value."""
    if not text:
        return None
    stage, sep, point = text.rpartition(":")
    if not sep or not stage or point not in POINTS:
        raise ValueError(f"K3RL_FAULT={text!r}: expected <stage>:<point> with <point> one of {', '.join(POINTS)} "
                         f"(e.g. rollout-iter1:mid-write); unset it to run without fault injection")
    return stage, point


SPEC = parse(os.environ.get("K3RL_FAULT"))
GROUP = os.environ.get("K3RL_FAULT_SCOPE") == "group"
_stage: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("k3rl_fault_stage", default=())


@contextlib.contextmanager
def in_stage(*names: str) -> Iterator[None]:
    """Mark the body of the stage called ``names`` (its task run name, its key) as running in this
    thread, so that points reached inside it (its publishes) know whose they are."""
    token = _stage.set(names)
    try:
        yield
    finally:
        _stage.reset(token)


def reached(point: str, staging: Path | None = None) -> None:
    """Kill this process if ``K3RL_FAULT`` names ``point`` of the stage running in this thread (for
    ``enospc``: raise a full disk's ``OSError`` at ``mid-write``). ``staging``: the artifact's
    staging path (``mid-write`` and ``enospc`` cut it to half first)."""
    if SPEC is None:
        return
    stage, want = SPEC
    if want in _SIGNALS:
        if point in ("before-publish", "after-publish") and stage in _stage.get() and not _signalled:
            _signalled.append(point)
            os.kill(os.getpid(), _SIGNALS[want])
        return
    disk_full = want == "enospc" and point == "mid-write"
    if (want != point and not disk_full) or stage not in _stage.get():
        return
    victim = _cut_in_half(staging) if point == "mid-write" and staging is not None else None
    if disk_full:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(victim or staging))
    if GROUP:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _cut_in_half(staging: Path) -> Path | None:
    """Leave ``staging`` as a write interrupted halfway leaves it: its largest file (returned) holding
    only the first half of its bytes. The file is unlinked and written anew,
    never truncated in place: a staged file may be a hard link to a published one
    (``save_checkpoint`` links the trainer state's files), which must keep its bytes."""
    if staging.is_dir():  # the completion marker is written after this point
        files = [p for p in staging.rglob("*") if p.is_file()]
        if not files:
            return None
        victim = max(files, key=lambda p: (p.stat().st_size, str(p)))
    elif staging.is_file():
        victim = staging
    else:
        return None
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(data[: len(data) // 2])
    return victim
