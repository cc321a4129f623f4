"""What a task runner costs per rollout at N = 1: the rollout stage in the flow's process (``local``)
against the same rollout as one shard on one Dask worker (``--task-runner dask``) and on one Ray
engine actor (``--task-runner ray``), in one run.

Claim (issue 20): the overhead of the runner against ``local`` at N = 1. The default workload is
deliberately tiny (the ``tiny`` preset, 2 prompts x 2 samples x 2 tokens), so that the seconds per
rollout are the runner's fixed cost (submitting a task, its Prefect task run and cache lookup,
publishing and merging the shard table, and for Ray the call into the actor), not generation;
``--preset small --prompts 16 --samples 8 --new-tokens 16`` shows it against real work.

Each configuration runs one untimed rollout (engines built), then ``--repeats`` timed rollouts of new
iterations; printed: the median seconds per rollout and each runner's ratio to local, and the
difference (the added seconds per rollout).

Usage: PYTHONPATH=. python benchmarks/runner_overhead.py [--repeats 5] [--preset tiny] [--prompts 2]
       [--samples 2] [--new-tokens 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_dask_workers import prepare  # noqa: E402  (sets Prefect's env first)

import torch  # noqa: E402
from prefect import flow  # noqa: E402

from flows.scale import iteration_runner  # noqa: E402
from k3core.settings import RolloutSettings, ScaleOutSettings  # noqa: E402
from tasks.common import Run  # noqa: E402
from tasks.rollout import rollout, rollout_fanout  # noqa: E402


def _seconds(calls) -> list[float]:
    """Wall seconds of each call after the first (the first builds the engine)."""
    out = []
    for i, call in enumerate(calls):
        t0 = time.perf_counter()
        call()
        if i:
            out.append(time.perf_counter() - t0)
    return out


@flow(name="overhead-local")
def local_rollouts(root: str, weights, settings: RolloutSettings, repeats: int) -> list[float]:
    torch.set_num_threads(1)
    run = Run(root, "overhead-local")
    return _seconds([lambda i=i: rollout(run, i, weights, settings) for i in range(repeats + 1)])


@flow(name="overhead-fanout")
def fanout_rollouts(root: str, run_id: str, weights, settings: RolloutSettings, repeats: int) -> list[float]:
    run = Run(root, run_id)
    return _seconds([lambda i=i: rollout_fanout(run, i, weights, settings, 1) for i in range(repeats + 1)])


@flow(name="overhead-runner")
def runner_rollouts(root: str, weights, settings: RolloutSettings, repeats: int, runner_name: str) -> list[float]:
    run_id = f"overhead-{runner_name}"
    with iteration_runner(ScaleOutSettings(task_runner=runner_name, rollout_workers=1), run_id) as runner:
        return fanout_rollouts.with_options(task_runner=runner())(root, run_id, weights, settings, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="k3rl-bench-overhead-")
    settings = RolloutSettings(prompts_per_iteration=a.prompts, samples_per_prompt=a.samples,
                               max_new_tokens=a.new_tokens)
    weights = prepare(root, a.preset)
    print(f"{a.preset} preset, W4A8 engine; {a.prompts} prompts x {a.samples} samples x <= {a.new_tokens} tokens; "
          f"{os.cpu_count()} cores, load averages at start {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    rows = {"local": statistics.median(local_rollouts(root, weights, settings, a.repeats))}
    for name in ("dask", "ray"):
        rows[f"{name} N=1"] = statistics.median(runner_rollouts(root, weights, settings, a.repeats, name))
    print(f"load averages at end {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'row':<10} {'s/rollout':>10} {'vs local':>9} {'added s':>8}")
    for name, s in rows.items():
        print(f"{name:<10} {s:10.3f} {s / rows['local']:8.2f}x {s - rows['local']:8.3f}")


if __name__ == "__main__":
    main()
