"""Claim: `k3rl run` at its default settings learns, from a warm start (`make run`) and from RL alone.

Two checks, each a real `k3rl run` subprocess (Prefect embedded mode, the W4A8 rollout engine, every
stage and file as a user gets them):

- ``demo``: `make run`'s command (`--preset small`, 30 iterations of `reverse` after the supervised
  warm-up). Reports the wall time and the held-out reward, sampled and greedy, at the start and the
  end of the run.
- ``rl-alone``: the same defaults with no warm-up, on a dense environment defined here and shipped
  nowhere else (``PromptLetterShare``: the share of the completion's characters that are letters of
  the prompt), for each seed. A fresh model emits any of 260 tokens, so it starts near 0.013;
  emitting lowercase letters alone reaches about 0.13, and more takes copying from the prompt.
  Reports the mean training reward of the first and the last three iterations, and the held-out
  reward (sampled, greedy) at the start and the end.

Extra arguments after ``--`` go to every `k3rl run` (e.g. ``-- --lr 1e-3`` to compare a setting).

    python benchmarks/rl_defaults.py [--checks demo,rl-alone] [--seeds 0 1 2] [--iterations 30] [-- ARGS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class PromptLetterShare:
    """``"say:qxf="`` -> anything; reward: the share of the completion's characters that are letters
    of the prompt's word (0 for an empty completion). No reference answers: the warm-up has nothing
    to teach, so RL alone must find the behaviour."""

    name = "prompt-letter-share"

    def prompts(self, rng, n):
        return ["say:" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 4))) + "="
                for _ in range(n)]

    def reward(self, prompt, completion):
        letters = set(prompt[len("say:"):-1])
        return sum(c in letters for c in completion) / len(completion) if completion else 0.0


def make_env() -> PromptLetterShare:
    return PromptLetterShare()


def k3rl_run(artifacts: str, run_id: str, args: list[str]) -> tuple[dict, float]:
    """One `k3rl run --json`: (its summary, wall seconds)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "flows.cli", "run", "--run-id", run_id, "--artifacts", artifacts, "--json",
           "--no-progress", *args]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout[p.stdout.index("{"):]), seconds


def metrics(artifacts: str, run_id: str) -> list[dict]:
    return json.loads((Path(artifacts) / "runs" / run_id / "metrics.json").read_text())


def heldout(summary: dict) -> str:
    return (f"held-out sampled {summary['heldout_reward_start']:.3f} -> {summary['heldout_reward_end']:.3f}, "
            f"greedy {summary['heldout_greedy_reward_start']:.3f} -> {summary['heldout_greedy_reward_end']:.3f}")


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checks", default="demo,rl-alone")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--preset", default="small")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load average {load:.2f} at the start; extra arguments: {extra or 'none'}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="k3rl-rl-defaults-") as artifacts:
        base = ["--preset", a.preset, "--iterations", str(a.iterations), *extra]
        if "demo" in a.checks.split(","):
            summary, seconds = k3rl_run(artifacts, "demo", base)
            print(f"demo: {seconds / 60:.1f} min, {heldout(summary)}", flush=True)
        if "rl-alone" in a.checks.split(","):
            gains = []
            for seed in a.seeds:
                run_id = f"rl-alone-{seed}"
                summary, seconds = k3rl_run(artifacts, run_id, [*base, "--env", "benchmarks.rl_defaults:make_env",
                                                                 "--warmup-steps", "0", "--seed", str(seed)])
                r = [m["reward_mean"] for m in metrics(artifacts, run_id)]
                first, last = statistics.mean(r[:3]), statistics.mean(r[-3:])
                gains.append(last - first)
                print(f"rl-alone seed {seed}: {seconds / 60:.1f} min, training reward (mean of 3 iterations) "
                      f"{first:.3f} -> {last:.3f} (gain {last - first:+.3f}), {heldout(summary)}", flush=True)
            print(f"rl-alone: mean gain {statistics.mean(gains):+.3f}, smallest {min(gains):+.3f} over seeds "
                  f"{a.seeds}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end", flush=True)


if __name__ == "__main__":
    main()
