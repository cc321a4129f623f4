"""Rollout throughput of the pipeline's rollout stage fanned out over Ray engine actors
(``--task-runner ray``), against the same stage in the flow's process (``local``), in one run.

Claim (issue 20): rollout tokens/s with 1 and 2 Ray engine workers of one torch thread each on this
2-core machine (the Dask rows are ``benchmarks/rollout_dask_workers.py``; target there: >= 1.7x at 2).

Workload and timing as in ``rollout_dask_workers.py``: the small preset's W4A8 engine, ``--prompts``
prompts x ``--samples`` samples x up to ``--new-tokens`` tokens, one untimed rollout that builds the
engines, then ``--repeats`` timed rollouts of new iterations on the resident engines; timed is the
flow's wall time of the stage (local: ``rollout``; ray: ``rollout_fanout``: submit the shard tasks,
which call the engine actors, wait, merge and publish), tokens = generated tokens in the table.

Rows:
  local x1 thread   the stage in the flow's process, torch.set_num_threads(1) (the baseline)
  ray N=1, N=2      a local Ray instance of N CPUs, N engine actors, N shards
  actors N=1, N=2   no Prefect, no tables: N bare actors each build an engine (untimed), then all
                    start ``generate`` on their share of the same prompts at one instant;
                    tokens / (last end - first start): what the cores give N engines in Ray actors.

Usage: PYTHONPATH=. python benchmarks/rollout_ray_workers.py [--repeats 3] [--prompts 16] [--samples 8]
       [--new-tokens 16] [--preset small]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_dask_workers import _timed, compare_workers  # noqa: E402  (sets Prefect's env first)

import torch  # noqa: E402
from prefect import flow  # noqa: E402

from flows.scale import iteration_runner  # noqa: E402
from k3core.settings import RolloutSettings, ScaleOutSettings  # noqa: E402
from tasks.common import Run  # noqa: E402
from tasks.rollout import rollout_fanout  # noqa: E402


@flow(name="bench-ray-iterations")
def ray_iterations(root: str, weights, settings: RolloutSettings, repeats: int, workers: int) -> list[float]:
    run = Run(root, f"bench-ray{workers}")
    return _timed([lambda i=i: rollout_fanout(run, i, weights, settings, workers) for i in range(repeats + 1)])


@flow(name="bench-ray")
def ray_rollouts(root: str, weights, settings: RolloutSettings, repeats: int, workers: int) -> list[float]:
    with iteration_runner(ScaleOutSettings(task_runner="ray", rollout_workers=workers), f"bench-ray{workers}") as runner:
        return ray_iterations.with_options(task_runner=runner())(root, weights, settings, repeats, workers)


class BareEngine:
    """An engine in a Ray actor, nothing else (the ``actors`` rows)."""

    def __init__(self, path: str, new_tokens: int, samples: int):
        torch.set_num_threads(1)
        from k3core.rl.weights import build_engine
        from k3core.rollout.engine import SamplingParams
        from k3core.tokenizer import ByteTokenizer

        self.eng = build_engine(path, 0)
        self.tok = ByteTokenizer(self.eng.model.config)
        self.params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=samples,
                                     stop_token_ids=(self.tok.eos_id,), seed=5)
        self.eng.generate([self.tok.encode("rev:ab=")], self.params)  # first-call costs, untimed

    def share(self, lo: int, hi: int, prompts: int, start_at: float):
        from k3core.rl.data import training_prompts
        from k3core.rl.envs import load_env

        ids = [self.tok.encode(p) for p in training_prompts(load_env("reverse"), 0, 99, prompts, "reverse")][lo:hi]
        while time.time() < start_at:
            time.sleep(0.01)
        t0 = time.time()
        out = self.eng.generate(ids, self.params)
        return sum(len(c.output_ids) for c in out), t0, time.time()


def actors_only(path: str, workers: int, a) -> float:
    import ray

    ray.init(address="local", num_cpus=workers, include_dashboard=False, object_store_memory=256 * 2**20,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}})
    try:
        cls = ray.remote(BareEngine).options(num_cpus=1)
        actors = [cls.remote(path, a.new_tokens, a.samples) for _ in range(workers)]
        ray.get([x.__ray_ready__.remote() for x in actors])  # every engine built
        go = time.time() + 2
        res = ray.get([x.share.remote(k * a.prompts // workers, (k + 1) * a.prompts // workers, a.prompts, go)
                       for k, x in enumerate(actors)])
    finally:
        ray.shutdown()
    return sum(r[0] for r in res) / (max(r[2] for r in res) - min(r[1] for r in res))


def main() -> None:
    compare_workers("ray", ray_rollouts, "actors", actors_only)


if __name__ == "__main__":
    main()
