"""Claim: minibatch PPO updates (several optimizer steps per rollout batch, logp_old taken once, the
clip engaged) learn more per iteration than the single on-policy update, at a wall-time cost.

RL alone, no warm-up, from the seeded init of a preset, on a dense environment defined here (the
share of lowercase ASCII letters in the completion; not one the pipeline ships). The loop is the
pipeline's functions without Prefect or files (as tests/k3core/rl/test_learning.py): prompts from the
data cursor, rollouts on the embedded float engine, ``score_table``, ``train_on_table``
(``StreamedAdamW``), in-process weight load. Held-out reward (16 held-out prompts x 4 samples, one
fixed sampling seed) every ``--eval-every`` iterations; per configuration and seed: the curve, the
gain, and the median seconds per iteration (rollout + score + train + weight load) over the
iterations that trained (once every group's rewards are equal, e.g. all 1.0, the update is skipped).

Configurations (``--configs``): ``single`` (1 epoch x 1 minibatch, lr), ``minibatch`` (2 epochs x 2
minibatches, lr: four steps per batch), ``single-4lr`` (one step at 4 x lr: the same step budget as
``minibatch`` in one on-policy step).

    python benchmarks/rl_updates.py [--preset tiny] [--iterations 20] [--seeds 0 1 2] [--lr 3e-3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.off_policy import LowercaseShare  # noqa: E402  (the benchmarks' dense environment)

CONFIGS = {
    "single": lambda lr: dict(lr=lr),
    "minibatch": lambda lr: dict(lr=lr, ppo_epochs=2, minibatches=2),
    "single-4lr": lambda lr: dict(lr=4 * lr),
}


def run(preset: str, seed: int, iterations: int, grpo: dict, eval_every: int, prompts: int, group: int,
        max_new: int) -> dict:
    from k3core.config import K3Config
    from k3core.rl.loop import rl_in_process
    from k3core.settings import GRPOSettings

    r = rl_in_process(LowercaseShare(), "bench:lowercase-share", K3Config.preset(preset), seed, iterations,
                      GRPOSettings(**grpo), prompts, group, max_new, eval_every=eval_every)
    # an iteration whose groups were all uniform trains nothing: not timed
    trained = [(s, m) for s, m in zip(r["seconds"], r["metrics"]) if not m["skipped"]]
    return dict(curve=r["heldout"], seconds_per_iteration=statistics.median(s for s, _ in trained),
                clip_fraction_mean=statistics.mean(m["clip_fraction"] for _, m in trained),
                iterations_trained=len(trained))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write every curve here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = {}
    for name in a.configs.split(","):
        grpo = CONFIGS[name](a.lr)
        for seed in a.seeds:
            r = run(a.preset, seed, a.iterations, grpo, a.eval_every, a.prompts, a.group, a.max_new_tokens)
            results[(name, seed)] = r
            c = r["curve"]
            print(f"{name:<11} seed {seed}: held-out " + " ".join(f"{k}:{v:.3f}" for k, v in c.items())
                  + f" | {r['seconds_per_iteration']:.2f} s/iter, clip fraction {r['clip_fraction_mean']:.3f}",
                  flush=True)
    print(f"\npreset {a.preset}, {a.iterations} iterations, {a.prompts} prompts x {a.group} samples, "
          f"{a.max_new_tokens} new tokens, lr {a.lr}, seeds {a.seeds}, {a.threads} thread(s)")
    print("| config | held-out start | held-out end (mean, min-max) | gain (mean) | s / iteration (median of seeds) |")
    print("|---|---|---|---|---|")
    base = None
    for name in a.configs.split(","):
        rs = [results[(name, s)] for s in a.seeds]
        start = [r["curve"][0] for r in rs]
        end = [r["curve"][a.iterations] for r in rs]
        gain = statistics.mean(e - s for s, e in zip(start, end))
        base = gain if base is None else base
        sec = statistics.median(r["seconds_per_iteration"] for r in rs)
        print(f"| {name} | {statistics.mean(start):.3f} | {statistics.mean(end):.3f} ({min(end):.3f}-{max(end):.3f}) "
              f"| {gain:+.3f} ({gain / base:.2f}x) | {sec:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({f"{k[0]}:{k[1]}": v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
