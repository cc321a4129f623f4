"""save_checkpoint: make a trained state durable and commit it as the run's checkpoint for its weight
version.

1. The trainer state (``runs/<id>/iter-N/trainer``): when the train step left it live in this
   process (``k3core.rl.trainers``), it is written here with torch.distributed.checkpoint through
   the O_DIRECT writer, each file hashed as it is written (the manifest takes those digests, so
   nothing is read back). The flow runs this stage beside the next iteration (``flows.pipeline``),
   whose first optimizer step freezes the writer before it changes the live state: the writer copies
   the tensors it has not read yet into an arena kept for the next freeze (host memory: at most one
   state's bytes, ``snapshot_arena``) and goes on writing beside the update, so the update waits for
   a memory copy, not for the disk. A state the train step already published (a torchrun job, a resumed run) is taken
   as it is.
2. The checkpoint (``runs/<id>/checkpoints/iter-V``): the state's files hard-linked where possible,
   a manifest of their sha256 (``published_sha256``: a linked file's digest is the one recorded when
   it was written, a stat, not a read of the whole state), then the ``latest`` pointer, last.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

from k3core.artifacts import Artifact, published_sha256, sha256_file
from k3core.rl import trainers
from tasks.common import Run, stage


@functools.cache
def snapshot_arena():
    """Where the freezes of this process's writes copy to: the largest so far (at most one trainer
    state's bytes) stays allocated for the next, whose copy then runs at memory speed, not at the
    speed of first-touch page faults."""
    from k3core.checkpoint.odirect import SnapshotArena

    return SnapshotArena()


def writer_options(cores: int | None = None) -> dict:
    """How the trainer state is written. With 8 cores or more: four files at once, four pwrites in
    flight, 16 MiB buffers (10 of them: 160 MiB of host memory whatever the state's size), the best
    of the settings docs/results/checkpoints_off_critical_path.md measured that keep the pool small.
    With fewer cores the write shares them with the stages it runs beside, and every thread it adds
    competes with theirs for the cores and the interpreter lock: one file, one pwrite in flight."""
    cores = cores or os.cpu_count() or 1
    if cores >= 8:
        return dict(thread_count=4, io_threads=4, buffer_bytes=16 << 20, num_buffers=10)
    return dict(thread_count=1, io_threads=1, buffer_bytes=16 << 20, num_buffers=4)


@stage(run_name="save_checkpoint-iter{iteration}", key="save",
       outputs=lambda run, trained, **_: [run.uri(run.checkpoint_rel(trained.version))],
       inputs=lambda trained, **_: [trained.uri])
def save_checkpoint(run: Run, iteration: int, trained: Artifact) -> Artifact:
    """The checkpoint of ``trained`` (weight version ``trained.version``, after iteration ``iteration``)."""
    store, rel = run.store, run.checkpoint_rel(trained.version)
    src = write_trainer_state(run, iteration, trained)

    def build(tmp):
        names, linked = [], []
        for p in sorted(x for x in src.rglob("*") if x.is_file()):
            dst = tmp / "state" / p.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, dst)
            except OSError:
                shutil.copy2(p, dst)
            names.append(str(p.relative_to(src)))
            linked.append(dst)
        # a hard link is the trained state's own file, whose bytes were hashed as they were written: a stat
        files = dict(zip(names, published_sha256(linked)))
        manifest = {"run_id": run.run_id, "iteration": trained.version, "version": trained.version,
                    "trained_from": trained.uri, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))

    local = store.publish_once(rel, build, is_dir=True)
    pointer = {"run_id": run.run_id, "iteration": trained.version, "checkpoint": store.uri(rel),
               "version": trained.version}
    with trainers.latest_lock:  # last: a crash before keeps the old; and it only moves forward
        if _pointed_at(store, run.layout.latest) < trained.version:
            store.replace_text(run.layout.latest, json.dumps(pointer, indent=2))
    return Artifact(kind="dcp", uri=store.uri(rel), path=str(local / "state"), sha256=sha256_file(local / "manifest.json"),
                    version=trained.version, info={"manifest": store.uri(f"{rel}/manifest.json")})


def _pointed_at(store, rel: str) -> int:
    """The version ``latest`` names now (-1: none, or one this process cannot read)."""
    try:
        return int(json.loads(store.read_text(rel))["version"]) if store.exists(rel) else -1
    except (ValueError, KeyError, TypeError):
        return -1


def write_trainer_state(run: Run, iteration: int, trained: Artifact) -> Path:
    """The local directory of the published trainer state of ``trained``: written now from the live
    trainer when it is not published yet."""
    from k3core.checkpoint.odirect import ODirectFileSystemWriter, one_intra_op_thread
    from k3core.rl.trainer_state import save_trainer_state

    if not trainers.unwritten(trained):  # the train step published it (torchrun, a resumed run)
        return Path(trained.path)

    def build(tmp):
        live = trainers.being_written(run.run_id, trained.version)  # the next update may have taken it already
        if live is None:
            raise RuntimeError(f"trainer state {trained.uri} (version {trained.version}) is not written and not live "
                               "in this process: re-run the same command, which resumes from the last checkpoint")
        def writer(path):  # freezable: the next update copies what it has not written yet, then goes on
            w = ODirectFileSystemWriter(path, freezable=True, snapshot_arena=snapshot_arena(), **writer_options())
            trainers.writing_with(live, w)
            return w

        with one_intra_op_thread():  # beside other stages: no OpenMP team of its own
            save_trainer_state(tmp / "state", live.model, live.optimizer, live.extra, storage_writer_factory=writer,
                               rng=live.rng)

    try:
        return run.store.publish_once(run.layout.trainer_rel(iteration), build, is_dir=True) / "state"
    finally:
        trainers.written(run.run_id, trained.version)
