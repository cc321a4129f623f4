"""The process's live trainer, one per run id: the model and optimizer a train step just saved, with
the RNG states it saved, at that weight version.

The next stages of the iteration (weight transfer, the next mismatch metric, the next train step)
take it from here instead of reading the trainer state back from DCP, so a trainer state is read at
most once per iteration (after a restart) and in a continuing run never. Correctness never depends on
this registry: an entry is used only for the exact run and version it holds, a train step takes it
out before changing it (a failed step leaves nothing behind), and a fresh process reads the durable
artifact instead. Training from the live entry restores the RNG states saved with it, so a resumed
run and a continuing run draw the same numbers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from k3core.artifacts import Artifact

_lock = threading.Lock()
# held while a save commits ``latest.json``: two saves of one run can commit at once (the last
# iteration saves its own state while the save of the one before, written behind it, may still be
# finishing), and ``latest`` must end at the newer. Here, not in ``tasks.save``: Dask pickles that
# module's functions by value, and a lock does not pickle.
latest_lock = threading.Lock()
_live: dict[str, LiveTrainer] = {}
_being_written: dict[tuple[str, int], LiveTrainer] = {}  # (run id, version): a write behind reads it


@dataclass
class LiveTrainer:
    version: int
    model: Any
    optimizer: Any
    extra: dict
    rng: tuple
    # while this state is being written beside the next stages: that write (the next update calls its
    # ``release`` before its first optimizer step), and the storage writer it writes with once it has one
    writing: WriteBehind | None = None
    writer: Any = None


@dataclass
class WriteBehind:
    """A write of ``live``'s state running beside the stages after it: ``join`` returns once it is
    durable (raises its error), ``done`` says whether it ended."""
    live: LiveTrainer
    join: Callable[[], Any]
    done: Callable[[], bool]

    def release(self) -> None:
        """Return once the state may change: the write's storage writer has copied what it has not
        read yet (``ODirectFileSystemWriter.freeze``; the write goes on beside the update), or the
        write ended (its error raised)."""
        while True:
            writer = self.live.writer
            if writer is not None and writer.freeze(timeout=0.05):
                return
            if self.done():
                self.join()
                return
            if writer is None:
                time.sleep(0.01)


def write_behind(run_id: str, version: int, join: Callable[[], Any], done: Callable[[], bool]) -> None:
    """Record that the live trainer at ``version`` is being written (``WriteBehind``); the writer
    finds it with ``being_written`` even after the next update has taken it out of the registry."""
    live = peek(run_id, version)
    if live is not None:
        with _lock:
            live.writing = WriteBehind(live, join, done)
            _being_written[(run_id, version)] = live


def writing_with(live: LiveTrainer, writer: Any) -> None:
    """The write of ``live``'s state uses ``writer``, a freezable storage writer: the next update
    freezes it instead of waiting for the disk. Refused when an earlier attempt's writer was frozen:
    the update may have changed the state since, so writing it again would mix two versions."""
    if live.writer is not None and live.writer.frozen:
        raise RuntimeError(f"the write of trainer state version {live.version} failed after the next update had "
                           "started changing it: re-run the same command, which resumes from the last checkpoint")
    live.writer = writer


def being_written(run_id: str, version: int) -> LiveTrainer | None:
    """The live trainer at ``version`` that a write behind reads: the one ``write_behind`` recorded,
    or the registry's."""
    with _lock:
        live = _being_written.get((run_id, version))
    return live if live is not None else peek(run_id, version)


def written(run_id: str, version: int) -> None:
    """The write of ``version`` ended (or was not needed): forget it."""
    with _lock:
        _being_written.pop((run_id, version), None)


@contextlib.contextmanager
def update_after_write(live: LiveTrainer):
    """Within the block, the optimizer's first step first releases the write of ``live``'s state (if
    one is running, ``WriteBehind.release``): the forward and backward passes before it read what the
    write reads and change none of it (the optimizer state, the buffers), so they run beside it; the
    step may change the state only once the writer holds its own copy of what it has still to write.
    Yields a dict that gets ``release_seconds``: how long the step waited for the release."""
    with _lock:
        writing, live.writing = live.writing, None
    waited: dict[str, float] = {}
    if writing is None:
        yield waited
        return

    def release(*_):
        if "release_seconds" not in waited:
            t0 = time.perf_counter()
            writing.release()
            waited["release_seconds"] = time.perf_counter() - t0

    handle = live.optimizer.register_step_pre_hook(release)
    try:
        yield waited
        release()  # no step was taken (no informative group): released before the state moves on
    finally:
        handle.remove()


def unwritten(state: Artifact) -> bool:
    """Whether ``state`` is the handle of a trainer state that is live in its process and not written
    yet (``tasks.train.live_handle``: ``info["durable"]`` False): nothing of it is on disk."""
    return state.info.get("durable", True) is False


def put(run_id: str, live: LiveTrainer) -> None:
    with _lock:
        _live[run_id] = live


def take(run_id: str, version: int | None) -> LiveTrainer | None:
    """The live trainer at ``version``, removed from the registry (the caller will change it)."""
    with _lock:
        live = _live.get(run_id)
        if live is None or live.version != version:
            return None
        return _live.pop(run_id)


def peek(run_id: str, version: int | None) -> LiveTrainer | None:
    """The live trainer at ``version`` for reading only (the caller must not change the model)."""
    with _lock:
        live = _live.get(run_id)
        return live if live is not None and live.version == version else None


def clear() -> None:
    with _lock:
        _live.clear()
        _being_written.clear()


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def dtype_of(model) -> torch.dtype:
    """The model's weight dtype: its embedding's (a few parameters, e.g. KDA's A_log, stay fp32
    whatever the dtype, ``K3ForCausalLM.cast``)."""
    return model.model.embed_tokens.weight.dtype


def weights(run_id: str, state: Artifact, device: str = "cpu", dtype: str = "float32"):
    """The trainer's model at ``state`` on ``device``, its weights in ``dtype``, for reading (the
    caller must not change it): the live one; or, for a DCP trainer state, the whole trainer read
    once onto ``device`` and kept live (the train step that follows takes it from here with its saved
    RNG states); or a public-layout checkpoint, loaded. A live trainer on another device or in
    another dtype is dropped and read again. The process's RNG states are left as they were."""
    from k3core.device import torch_dtype

    if state.kind != "dcp":
        from k3core.rl.weights import load_policy

        return load_policy(state.path, torch_dtype(dtype), device=device)
    live = peek(run_id, state.version)
    if live is not None and (_device_of(live.model).type != torch.device(device).type
                             or dtype_of(live.model) != torch_dtype(dtype)):
        take(run_id, state.version)
        live = None
    if live is None:
        from k3core.rl.trainer_state import load_trainer_state, rng_state, set_rng_state

        mine = rng_state()
        try:  # loading restores the state's RNG: keep it with the trainer, give the process its own back
            model, optimizer, extra = load_trainer_state(state.path, lr=0.0, dtype=torch_dtype(dtype), device=device)  # lr: the saved groups win
            live = LiveTrainer(state.version, model, optimizer, extra, rng_state())
        finally:
            set_rng_state(mine)
        put(run_id, live)
    return live.model
