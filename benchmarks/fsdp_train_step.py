"""FSDP2 train step under torchrun (k3core.rl.fsdp): step time and peak memory per rank at 1 and 2
ranks, against the one-process step (``train_on_table`` in this process, no torchrun) as the baseline.

One scored batch (the small preset's W4A8 engine: ``--prompts`` (16) x 8 samples, 8 new tokens, rewards =
fraction of even bytes so every group trains), one GRPO update of the pipeline's default settings.
Rows:
  in-process cold  train_on_table, the first step in this process (the baseline: like a torchrun
                   job, it pays first-call costs)
  in-process warm  the median of the next steps in this process (what a long-running one-process
                   pipeline pays after its first iteration)
  torchrun x1      the torchrun job with 1 rank (FSDP2 over one rank)
  torchrun x2      2 ranks (gloo)
Every process runs ``--threads`` torch threads (default 1: on a shared machine, a parallel region
of as many threads as cores stalls whenever another job takes one core, which swamped the figures).
Every torchrun job is fresh processes, as in the pipeline (one job per iteration), so its update
includes first-call costs.
"train s" is the update alone (rank 0's ``train_seconds``: forward, backward, reduce-scatter,
optimizer); "job s" is the whole job as the task sees it (interpreter and torch start-up, load,
update, DCP save through the O_DIRECT writer); "peak RSS" is each rank's peak resident memory after
the update (``ru_maxrss``), the in-process row this process's.

Usage: python benchmarks/fsdp_train_step.py [--preset small] [--repeats 3] [--prompts 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from k3core.rl.prompting import PromptFormat
from k3core.checkpoint.hf import init_checkpoint, quantize_checkpoint
from k3core.rl.data import training_prompts
from k3core.rl.envs import ReverseEnv
from k3core.rl.fsdp import TrainJob, run_train_job
from k3core.rl.tables import rollout_table, score_table
from k3core.rl.train import train_on_table
from k3core.rl.trainer_state import make_optimizer
from k3core.rl.weights import build_engine, load_policy
from k3core.rollout.engine import SamplingParams
from k3core.settings import GRPOSettings
from k3core.tokenizer import ByteTokenizer


class EvenBytes(ReverseEnv):
    def reward(self, prompt, completion):
        data = completion.encode()
        return sum(b % 2 == 0 for b in data) / len(data) if data else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    tmp = Path(tempfile.mkdtemp(prefix="k3rl-bench-fsdp-"))
    init_checkpoint(a.preset, tmp / "ckpt", seed=0)
    quantize_checkpoint(tmp / "ckpt", tmp / "q")
    engine = build_engine(tmp / "q", 0)
    tok = ByteTokenizer(engine.model.config)
    env = EvenBytes()
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=8, stop_token_ids=(tok.eos_id,), seed=1)
    table, _ = score_table(rollout_table(engine, PromptFormat.of(tok, mode="raw"), training_prompts(env, 0, 0, a.prompts, "reverse"), params, 0), env,
                           "even-bytes", 8)
    pq.write_table(table, tmp / "scored.parquet")
    del engine
    g = GRPOSettings()
    start = load_policy(tmp / "ckpt")
    n_params = sum(p.numel() for p in start.parameters())
    print(f"preset {a.preset} ({n_params / 1e6:.1f}M parameters), {table.num_rows} sequences, {cores} cores, "
          f"{a.threads} torch thread(s) per process, "
          f"load average {os.getloadavg()[0]:.1f}")

    rows = {}
    torch.set_num_threads(a.threads)
    times = []
    for _ in range(a.repeats + 1):
        model = copy.deepcopy(start)
        opt = make_optimizer(model, g.lr)
        m = train_on_table(model, opt, table, g, tok.pad_id, seq_sum_norm=8, max_groups=a.prompts)
        times.append(m["train_seconds"])
    rss = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]
    rows["in-process cold"] = (times[0], None, rss)
    rows["in-process warm"] = (statistics.median(times[1:] or times), None, rss)

    for procs in (1, 2):
        train, job_s, rss = [], [], None
        for r in range(a.repeats):
            job = TrainJob(state=str(tmp / "ckpt"), state_kind="public", tables=[str(tmp / "scored.parquet")],
                           grpo=dataclasses.asdict(g), out=str(tmp / f"out-{procs}-{r}"), seq_sum_norm=8,
                           max_groups=a.prompts)
            t0 = time.perf_counter()
            m = run_train_job(job, procs, tmp / f"work-{procs}-{r}", threads_per_proc=a.threads)["metrics"]
            job_s.append(time.perf_counter() - t0)
            train.append(m["train_seconds"])
            rss = m["peak_rss_mib_per_rank"]
        rows[f"torchrun x{procs}"] = (statistics.median(train), statistics.median(job_s), rss)

    base = rows["in-process cold"][0]
    print(f"{'row':<16} {'train s':>8} {'vs in-process cold':>19} {'job s':>7}  peak RSS per rank (MiB)")
    for name, (train, job, rss) in rows.items():
        job_txt = f"{job:7.2f}" if job is not None else "      -"
        print(f"{name:<16} {train:8.3f} {base / train:18.2f}x {job_txt}  {', '.join(f'{x:.0f}' for x in rss)}")


if __name__ == "__main__":
    main()
