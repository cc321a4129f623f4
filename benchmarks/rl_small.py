"""Claim: the RL loop learns. README command 1's run (small preset, this CPU, Prefect embedded mode):
held-out reward (on prompts training never sees; sampled as in training, and greedy) rises clearly above the level of
the starting checkpoint (the policy after the supervised warm-up, RL iteration 0), in about 10 min.

Runs the real flow (``flows.pipeline.rl_run``), prints start and end held-out reward with the
ratio, iterations, wall time per stage, and copies the reward/KL plot to ``--plot``.

    python benchmarks/rl_small.py [--iterations N] [--env reverse] [--artifacts DIR] [--plot docs/rl_small.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flows  # noqa: F401,E402  (sets Prefect's environment before it is imported)
from flows.pipeline import rl_run  # noqa: E402
from k3core.settings import RLSettings  # noqa: E402


def main() -> None:
    d = RLSettings()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=d.pipeline.iterations)
    ap.add_argument("--env", default=d.pipeline.env)
    ap.add_argument("--artifacts", default="build/rl_small_artifacts")
    ap.add_argument("--run-id", default=f"bench-{int(time.time())}")
    ap.add_argument("--plot", default=None, help="copy the final reward/KL plot here")
    a = ap.parse_args()
    s = RLSettings().replace(env=a.env, iterations=a.iterations, artifacts=a.artifacts, run_id=a.run_id)
    t0 = time.perf_counter()
    summary = rl_run(s)
    wall = time.perf_counter() - t0
    start, end = summary["heldout_reward_start"], summary["heldout_reward_end"]
    print(json.dumps(summary, indent=2))
    print(f"\nheld-out reward (sampled, {s.evaluation.prompts} prompts x 4): start {start:.3f} -> end {end:.3f} "
          f"({end / max(start, 1e-9):.2f}x the starting checkpoint); solved {summary['heldout_solved_start']:.3f} -> "
          f"{summary['heldout_solved_end']:.3f}")
    print(f"held-out reward (greedy): start {summary['heldout_greedy_reward_start']:.3f} -> "
          f"end {summary['heldout_greedy_reward_end']:.3f}")
    print(f"{summary['iterations']} iterations, wall {wall:.0f} s (flow {summary['wall_seconds']:.0f} s)")
    for k, v in summary["seconds_per_stage"].items():
        print(f"  {k:<20}{v:>8.1f} s")
    if a.plot:
        run = Path(a.artifacts) / "runs" / a.run_id
        png = sorted(run.glob("curves-*.png"))[-1]
        shutil.copyfile(png, a.plot)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
