"""Rollout throughput of the pipeline's rollout stage fanned out over Dask engine workers
(``--task-runner dask``), against the same stage in the flow's process (``local``), in one run.

Claims (issue 20): 2 Dask workers of one torch thread each give >= 1.7x the tokens/s of 1 such
worker on this 2-core machine; the runner's overhead at N = 1 against ``local`` (one torch thread).

Workload: the small preset's W4A8 engine (MXFP4 experts), ``--prompts`` prompts x ``--samples``
samples x up to ``--new-tokens`` tokens per rollout, the ``reverse`` environment's prompts; each
configuration first runs one rollout that builds its engines (not timed), then ``--repeats`` timed
rollouts of new iterations (new prompts, new seeds) on the resident engines. Timed: the flow's wall
time of the stage (local: ``rollout``; dask: ``rollout_fanout``, i.e. submit the shards, wait, merge
and publish the table), tokens = generated tokens in the published table. Prefect runs embedded.

Rows:
  local x1 thread   the stage in the flow's process, torch.set_num_threads(1) (the runner baseline)
  dask N=1          LocalCluster of 1 single-threaded worker process, 1 shard
  dask N=2          LocalCluster of 2 single-threaded worker processes, 2 shards

Usage: python benchmarks/rollout_dask_workers.py [--repeats 3] [--prompts 16] [--samples 8] [--new-tokens 16]
       [--preset small]   (tiny with a few tokens shows the runner's fixed cost per rollout)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from prefect import flow  # noqa: E402

from flows.scale import iteration_runner  # noqa: E402
from k3core.settings import RolloutSettings, ScaleOutSettings  # noqa: E402
from tasks.common import Run  # noqa: E402
from tasks.fetch import fetch_checkpoint  # noqa: E402
from tasks.quantize import quantize_mxfp4  # noqa: E402
from tasks.rollout import rollout, rollout_fanout  # noqa: E402


def _timed(calls) -> list[float]:
    """tokens/s of each call after the first (the first builds the engines)."""
    rates = []
    for i, call in enumerate(calls):
        t0 = time.perf_counter()
        out = call()
        dt = time.perf_counter() - t0
        if i:
            rates.append(out.info["tokens"] / dt)
    return rates


@flow(name="bench-prepare")
def prepare(root: str, preset: str):
    run = Run(root, "bench-src")
    return quantize_mxfp4(run, fetch_checkpoint(run, f"init:{preset}:0"))


@flow(name="bench-local")
def local_rollouts(root: str, weights, settings: RolloutSettings, repeats: int) -> list[float]:
    torch.set_num_threads(1)
    run = Run(root, "bench-local")
    return _timed([lambda i=i: rollout(run, i, weights, settings) for i in range(repeats + 1)])


@flow(name="bench-dask-iterations")
def dask_iterations(root: str, weights, settings: RolloutSettings, repeats: int, workers: int) -> list[float]:
    run = Run(root, f"bench-dask{workers}")
    return _timed([lambda i=i: rollout_fanout(run, i, weights, settings, workers) for i in range(repeats + 1)])


@flow(name="bench-dask")
def dask_rollouts(root: str, weights, settings: RolloutSettings, repeats: int, workers: int) -> list[float]:
    with iteration_runner(ScaleOutSettings(task_runner="dask", rollout_workers=workers)) as runner:
        return dask_iterations.with_options(task_runner=runner())(root, weights, settings, repeats, workers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--preset", default="small")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="k3rl-bench-dask-")
    settings = RolloutSettings(prompts_per_iteration=a.prompts, samples_per_prompt=a.samples,
                               max_new_tokens=a.new_tokens)
    weights = prepare(root, a.preset)
    print(f"{a.preset} preset, W4A8 engine; {a.prompts} prompts x {a.samples} samples x <= {a.new_tokens} tokens; "
          f"{os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.1f}")
    rows = {"local x1 thread": statistics.median(local_rollouts(root, weights, settings, a.repeats))}
    for n in (1, 2):
        rows[f"dask N={n}"] = statistics.median(dask_rollouts(root, weights, settings, a.repeats, n))
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    print(f"{'row':<16} {'tokens/s':>9} {'vs local':>9} {'vs dask N=1':>12}")
    for name, rate in rows.items():
        print(f"{name:<16} {rate:9.1f} {rate / rows['local x1 thread']:8.2f}x {rate / rows['dask N=1']:11.2f}x")


if __name__ == "__main__":
    main()
