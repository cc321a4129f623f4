"""The RL train step as a torchrun job of N processes, the model sharded with FSDP2.

Owns: sharding a ``K3ForCausalLM`` with FSDP2 (``shard_model``), one rank's train step (``main``,
the program torchrun starts: load, train, save) and its launch (``run_train_job``: torchrun with
``--standalone``, a rendezvous on this machine's loopback). Does not own: the update rule
(``k3core.rl.train``: the one-process code, told its rank through ``DataParallel``), the optimizer
(``StreamedAdamW`` holds and streams this rank's shard of every parameter), or the checkpoint
format (``k3core.rl.trainer_state``: one DCP directory that every rank writes its shards into
through the O_DIRECT writer, readable at any world size).

Sharding: one FSDP2 unit per decoder layer and one for the root (embedding, output mix, head),
every parameter split along dim 0 over the ranks (``Shard(0)``). Each rank trains on its share of
every micro-batch (``DataParallel``), so N ranks give one process's update up to the order of
floating-point sums.

Backend: gloo on CPU. The RL trainer runs on the CPU in this pipeline (the RL loop does not run on
a GPU yet), so the job has no NCCL path to offer.

The job is described by one JSON file (``TrainJob``): the trainer state to start from (a DCP
trainer state, or a public-layout checkpoint with a fresh optimizer and the caller's RNG state),
the scored tables, the GRPO settings and where to save.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["TrainJob", "TrainJobError", "main", "run_train_job", "shard_model"]


@dataclass
class TrainJob:
    """One distributed train step. ``state``: a trainer-state directory (``state_kind`` "dcp") or
    a public-layout checkpoint ("public": fresh optimizer, RNG from ``rng``, a file of
    ``torch.save((torch_rng_state, python_random_state))``). ``grpo``: ``GRPOSettings`` as a dict.
    ``out``: the directory the new trainer state is saved into (``extra`` plus the step's
    ``metrics`` go into its ``extra.json``). ``dtype``: the model's weights (the run's ``--dtype``;
    the optimizer's masters stay fp32)."""

    state: str
    state_kind: str
    tables: list[str]
    grpo: dict
    out: str
    temperature: float = 1.0
    seq_sum_norm: float | None = None
    max_groups: int | None = None
    extra: dict = field(default_factory=dict)
    rng: str | None = None
    odirect: bool = True
    dtype: str = "float32"

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(dataclasses.asdict(self)))
        return path

    @classmethod
    def read(cls, path: str | Path) -> TrainJob:
        return cls(**json.loads(Path(path).read_text()))


class TrainJobError(RuntimeError):
    """The torchrun job failed; the message carries the end of its output."""


def shard_model(model, mesh=None):
    """FSDP2 over ``mesh`` (default: every rank of the process group, CPU): each decoder layer is a
    unit, the root holds the rest. In place; returns the model."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _load(job: TrainJob):
    """(model, optimizer, extra of the state) on this rank, sharded."""
    from k3core.rl.trainer_state import load_trainer_state, make_optimizer, set_qat, set_rng_state
    from k3core.rl.weights import load_policy

    lr = job.grpo["lr"]
    if job.state_kind == "dcp":
        model, opt, extra = load_trainer_state(job.state, lr=0.0, dtype=getattr(torch, job.dtype),
                                               shard=shard_model)  # lr: the saved groups win
        return model, opt, extra
    if job.state_kind != "public":
        raise ValueError(f"state_kind {job.state_kind!r}: expected 'dcp' or 'public'")
    model = set_qat(load_policy(job.state, getattr(torch, job.dtype)), job.grpo["qat"])
    shard_model(model)
    if job.rng:
        set_rng_state(torch.load(job.rng, weights_only=False))
    return model, make_optimizer(model, lr), {}


def train_rank(job: TrainJob) -> dict:
    """This rank's part of the job (process group already initialised): load, train, save. -> metrics."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch.distributed as dist

    from k3core.rl.train import DataParallel, train_on_table
    from k3core.rl.trainer_state import QAT_KEY, save_trainer_state
    from k3core.settings import GRPOSettings

    settings = GRPOSettings(**job.grpo)
    model, opt, state_extra = _load(job)
    was = bool(state_extra.get(QAT_KEY, settings.qat))
    if was != settings.qat:
        raise ValueError(f"trainer state {job.state} was trained with QAT {was}, the job asks for {settings.qat}")
    table = pa.concat_tables([pq.read_table(p) for p in job.tables])
    dp = DataParallel(dist.get_rank(), dist.get_world_size())
    metrics = train_on_table(model, opt, table, settings, model.config.pad_token_id,
                             temperature=job.temperature, seq_sum_norm=job.seq_sum_norm, max_groups=job.max_groups,
                             dp=dp)
    metrics["train_procs"] = dp.world
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # this rank's peak so far (Linux: KiB)
    metrics["peak_rss_mib_per_rank"] = [kib / 1024 for kib in dp.gather(peak_kib)]
    box = [metrics]  # every rank saves the same extra (DCP keeps one copy of it): rank 0's timings
    dist.broadcast_object_list(box, src=0)
    metrics = box[0]
    writer = None
    if job.odirect:
        from k3core.checkpoint.odirect import ODirectFileSystemWriter

        writer = ODirectFileSystemWriter
    save_trainer_state(job.out, model, opt, {**job.extra, "metrics": metrics}, storage_writer_factory=writer)
    return metrics


def _record(fn):
    """torchrun's error recording: a failing rank's exception goes into the job's failure summary."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


@_record
def main(argv: list[str] | None = None) -> int:
    """The program torchrun starts on every rank: ``python -m k3core.rl.fsdp JOB.json``."""
    import torch.distributed as dist

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node N -m k3core.rl.fsdp JOB.json", file=sys.stderr)
        return 2
    job = TrainJob.read(argv[0])
    dist.init_process_group("gloo")
    try:
        metrics = train_rank(job)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"k3rl fsdp: {dist.get_world_size()} ranks, loss {metrics.get('loss', 0.0):.6f}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def run_train_job(job: TrainJob, procs: int, workdir: str | Path, threads_per_proc: int | None = None,
                  timeout: float | None = None) -> dict:
    """Run ``job`` as ``torchrun --standalone --nproc-per-node procs`` (loopback rendezvous, gloo),
    each rank with ``threads_per_proc`` torch threads (default: this machine's cores / procs).
    -> the ``extra.json`` the job saved (with ``metrics``). Raises ``TrainJobError`` with the
    job's output tail when any rank fails."""
    if procs < 1:
        raise ValueError(f"procs must be >= 1, got {procs}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = job.write(workdir / "train-job.json")
    threads = threads_per_proc or max(1, (os.cpu_count() or 1) // procs)
    root = str(Path(__file__).resolve().parents[2])  # the checkout k3core is imported from
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={procs}",
           "--master-addr=127.0.0.1", "-m", "k3core.rl.fsdp", str(spec)]
    proc = subprocess.run(cmd, env=env, cwd=str(workdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise TrainJobError(f"torchrun train job ({procs} processes) exited with status {proc.returncode}:\n{tail}")
    return json.loads((Path(job.out) / "extra.json").read_text())


if __name__ == "__main__":
    sys.exit(main())
