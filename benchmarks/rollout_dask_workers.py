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
  engines N=1, N=2  no Prefect, no tables: each worker builds an engine (untimed), then all start
                    ``generate`` on their contiguous share of the same prompts at one instant;
                    tokens / (last end - first start). What the cores give two engines, so that a
                    missing speed-up can be told apart from the runner's cost.

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
    with iteration_runner(ScaleOutSettings(task_runner="dask", rollout_workers=workers), "bench") as runner:
        return dask_iterations.with_options(task_runner=runner())(root, weights, settings, repeats, workers)


def _engine_share(path: str, lo: int, hi: int, prompts: int, samples: int, new_tokens: int, start_at: float):
    torch.set_num_threads(1)
    from k3core.rl.data import training_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.weights import build_engine
    from k3core.rollout.engine import SamplingParams
    from k3core.tokenizer import ByteTokenizer

    eng = build_engine(path, 0)
    tok = ByteTokenizer(eng.model.config)
    ids = [tok.encode(p) for p in training_prompts(load_env("reverse"), 0, 99, prompts, "reverse")][lo:hi]
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=samples, stop_token_ids=(tok.eos_id,), seed=5)
    eng.generate(ids[:1], params)  # first-call costs, untimed
    while time.time() < start_at:
        time.sleep(0.01)
    t0 = time.time()
    out = eng.generate(ids, params)
    return sum(len(c.output_ids) for c in out), t0, time.time()


def engines_only(path: str, workers: int, a) -> float:
    import dask
    from distributed import Client, LocalCluster

    from flows.scale import NO_MALLOC_TRIM

    with dask.config.set({NO_MALLOC_TRIM: None}):
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address=None)
    with cluster, Client(cluster) as client:
        go = time.time() + 30  # every worker has built its engine by then
        names = list(client.scheduler_info()["workers"])
        futures = [client.submit(_engine_share, path, k * a.prompts // workers, (k + 1) * a.prompts // workers,
                                 a.prompts, a.samples, a.new_tokens, go, workers=[w], pure=False)
                   for k, w in enumerate(names)]
        res = client.gather(futures)
    return sum(r[0] for r in res) / (max(r[2] for r in res) - min(r[1] for r in res))


def compare_workers(runner: str, runner_rollouts, bare_name: str, bare_rollouts) -> None:
    """The command line and table shared by the worker benchmarks: the local rollout stage, then
    ``runner_rollouts(root, weights, settings, repeats, n)`` (the stage through that task runner) and
    ``bare_rollouts(path, n, args)`` (the same engines without Prefect) at 1 and 2 workers, as
    tokens/s and as ratios against local and against each N=1 row of the same run."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--preset", default="small")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix=f"k3rl-bench-{runner}-")
    settings = RolloutSettings(prompts_per_iteration=a.prompts, samples_per_prompt=a.samples,
                               max_new_tokens=a.new_tokens)
    weights = prepare(root, a.preset)
    print(f"{a.preset} preset, W4A8 engine; {a.prompts} prompts x {a.samples} samples x <= {a.new_tokens} tokens; "
          f"{os.cpu_count()} cores, load averages at start {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    rows = {"local x1 thread": statistics.median(local_rollouts(root, weights, settings, a.repeats))}
    for n in (1, 2):
        rows[f"{runner} N={n}"] = statistics.median(runner_rollouts(root, weights, settings, a.repeats, n))
    for n in (1, 2):
        rows[f"{bare_name} N={n}"] = bare_rollouts(weights.path, n, a)
    print(f"load averages at end {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    first, bare = f"{runner} N=1", f"{bare_name} N=1"
    print(f"{'row':<16} {'tokens/s':>9} {'vs local':>9} {'vs ' + first:>12} {'vs ' + bare:>15}")
    for name, rate in rows.items():
        print(f"{name:<16} {rate:9.1f} {rate / rows['local x1 thread']:8.2f}x {rate / rows[first]:11.2f}x "
              f"{rate / rows[bare]:14.2f}x")


def main() -> None:
    compare_workers("dask", dask_rollouts, "engines", engines_only)


if __name__ == "__main__":
    main()
