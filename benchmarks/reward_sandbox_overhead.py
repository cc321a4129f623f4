"""Claim: a sandboxed reward call (a fresh confined process per call, forked from a warm worker)
costs a few milliseconds more than the same reward called in the scoring process; for a verifier
that does real work (the math verifier's sympy equivalence) the overhead is a small share of it.

Baseline, measured in the same run: the same environment's ``reward`` called in this process on the
same (prompt, completion) pairs. The sandbox is measured per call at 1 and 2 workers (the machine has
2 cores), its start-up (workers importing the environment) separately.

    python benchmarks/reward_sandbox_overhead.py --calls 400

Two environments: ``even-bytes`` (a user ``module:factory`` whose reward is a few string operations:
the sandbox's pure overhead) and the bundled ``math`` dataset (sympy). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # even_bytes_env: the tests' user environment

from k3core.rl.envs import load_env  # noqa: E402
from k3core.rl.sandbox import RewardSandbox, SandboxLimits  # noqa: E402


def pairs(spec: str, env, n: int) -> tuple[list[str], list[str]]:
    import random

    rng = random.Random(0)
    if spec == "math":
        prompts = [env.prompts_at(0, i, 1)[0] for i in range(n)]
        # half right in another form, half wrong: both paths of the verifier
        comps = [(env.reference(p) + "+0") if i % 2 else str(rng.randint(0, 99)) for i, p in enumerate(prompts)]
        return prompts, comps
    prompts = env.prompts(rng, n)
    return prompts, ["".join(rng.choice("abcdefgh") for _ in range(6)) for _ in prompts]


def in_process(env, prompts, comps) -> float:
    """Seconds per call over one pass, each pair scored once as the scoring stage does (a second pass
    would find sympy's cache warm with these very expressions, which no sandboxed call can)."""
    import os
    import tempfile

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        try:
            t0 = time.perf_counter()
            for p, c in zip(prompts, comps):
                env.reward(p, c)
            return (time.perf_counter() - t0) / len(prompts)
        finally:
            os.chdir(cwd)


def sandboxed(spec: str, prompts, comps, workers: int, repeats: int) -> tuple[float, float]:
    """(start-up seconds, seconds per call: median of ``repeats`` passes)."""
    t0 = time.perf_counter()
    with RewardSandbox(spec, SandboxLimits(timeout_s=30.0, workers=workers)) as sb:
        start = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = sb.score(prompts, comps)
            times.append((time.perf_counter() - t0) / len(prompts))
            assert not any(o.broken or o.stopped for o in outs)
    return start, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3, help="sandbox passes (the median is printed)")
    a = ap.parse_args()
    print(f"{'environment':<12} {'mode':<22} {'start s':>8} {'ms/call':>9} {'x in-process':>13} {'+ms/call':>9}")
    for spec, label, n in (("even_bytes_env:make", "even-bytes", a.calls), ("math", "math", a.calls // 4)):
        env = load_env(spec)
        if hasattr(env, "prepare"):
            env.prepare()
        prompts, comps = pairs(spec, env, n)
        base = in_process(env, prompts, comps)
        print(f"{label:<12} {'in process':<22} {'':>8} {base * 1e3:>9.3f} {1.0:>12.2f}x {0.0:>9.2f}")
        for workers in (1, 2):
            start, per = sandboxed(spec, prompts, comps, workers, a.repeats)
            print(f"{label:<12} {f'sandbox, {workers} worker(s)':<22} {start:>8.2f} {per * 1e3:>9.3f} "
                  f"{per / base:>12.1f}x {(per - base) * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
