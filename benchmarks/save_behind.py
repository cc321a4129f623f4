"""Checkpoints off the critical path: a run that writes its trainer state every iteration, behind the
next iteration's rollout (the default), against the same run with saving off (``--save-every``
beyond the run: only the last state is written), same command, same machine, one after the other.

Claim (issue 33): a steady iteration with the save behind the rollout takes at most 1.1x the
iteration with saving off, and the train stage is its update plus its log-probabilities, no longer
the state's write.

Variants: ``save behind`` (every state), ``save every 2`` (``--save-every 2``: every other state,
so a write has two iterations to hide behind), ``saving off``; ``--variants`` picks some. Per
iteration and variant: the iteration's seconds (with the flow's wait for the write that ran beside
it), the train stage's (``seconds_train``) and of it the update (``train_seconds``), how long the
update's first optimizer step waited for the write's freeze (``release_seconds``: the writer
copying what it had not read yet), how long the flow still waited for the write after the
iteration (``seconds_save_wait``) and how long that write ran (``seconds_save_ahead``), and a
synchronous save's seconds (the last iteration's). Steady: the mean over the iterations after the
first (compilation, first-call work) and before the last (its save has no next iteration to hide
behind). Disk: the bytes of one trainer state and of the run's directory at
the end (with ``--keep-checkpoints 1``).

Usage (from the repository root):
    python benchmarks/save_behind.py --preset small --iterations 5                      # CPU
    python benchmarks/save_behind.py --device cuda --preset medium --iterations 4 -- --warmup-steps 0
Arguments after ``--`` go to both ``k3rl run`` commands.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"save behind": [], "save every 2": ["--save-every", "2"], "saving off": ["--save-every", "1000000"]}
COLUMNS = ("seconds_iteration", "seconds_train", "train_seconds", "release_seconds", "seconds_save_wait",
           "seconds_save_ahead", "seconds_save")


def du(path: Path) -> int:
    """Bytes of the files under ``path``, each inode once (checkpoints are hard links of trainer states)."""
    seen, total = set(), 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def run_variant(name: str, extra: list[str], a: argparse.Namespace, passthrough: list[str]) -> dict:
    artifacts = a.dir / name.replace(" ", "-")
    shutil.rmtree(artifacts, ignore_errors=True)
    cmd = [sys.executable, "-m", "flows.cli", "run", "--preset", a.preset, "--device", a.device, "--iterations",
           str(a.iterations), "--run-id", "bench", "--artifacts", str(artifacts), "--keep-checkpoints", "1",
           "--no-progress", *extra, *passthrough]
    print(f"# {name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    log = a.dir / f"{artifacts.name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        print(log.read_text()[-3000:])
        raise SystemExit(f"{name}: k3rl run exited {rc} (log {log})")
    run = artifacts / "runs" / "bench"
    metrics = json.loads((run / "metrics.json").read_text())
    state = next(run.glob("iter-*/trainer/state"))
    out = {"wall": wall, "metrics": metrics, "state_bytes": du(state), "run_bytes": du(run)}
    if not a.keep:
        shutil.rmtree(artifacts, ignore_errors=True)
    return out


def main() -> None:
    argv = sys.argv[1:]
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="small")
    p.add_argument("--iterations", type=int, default=4, help="at least 3: one steady iteration")
    p.add_argument("--dir", type=Path, default=ROOT / "build" / "save_behind")
    p.add_argument("--keep", action="store_true", help="keep the runs' artifacts")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    a = p.parse_args(argv)
    chosen = [v.strip() for v in a.variants.split(",")]
    if unknown := [v for v in chosen if v not in VARIANTS]:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if a.iterations < 3:
        p.error("--iterations must be at least 3 (the first and the last iteration are not steady)")
    a.dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in chosen:
        extra = VARIANTS[name]
        results[name] = r = run_variant(name, extra, a, passthrough)
        for m in r["metrics"]:  # as it comes, in case a later variant does not finish
            print(f"# {name} iteration {m['iteration']}: " + ", ".join(
                f"{c} {m[c]:.2f}" for c in COLUMNS if isinstance(m.get(c), (int, float))), flush=True)
        print(f"# {name}: whole command {r['wall']:.1f} s, trainer state {r['state_bytes']} B, run directory "
              f"{r['run_bytes']} B", flush=True)

    print()
    print(f"{a.preset} on {a.device}, {a.iterations} iterations; seconds")
    print()
    print("| variant | iteration | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for name, r in results.items():
        for m in r["metrics"]:
            cells = " | ".join(f"{m[c]:.2f}" if isinstance(m.get(c), (int, float)) else "-" for c in COLUMNS)
            print(f"| {name} | {m['iteration']} | {cells} |")
    # means: with --save-every 2 the steady iterations alternate between one with a write beside it and one without
    steady = {name: statistics.mean(m["seconds_iteration"] for m in r["metrics"][1:-1]) for name, r in results.items()}
    train = {name: statistics.mean(m["seconds_train"] for m in r["metrics"][1:-1]) for name, r in results.items()}
    update = {name: statistics.mean(m.get("train_seconds", 0.0) for m in r["metrics"][1:-1])
              for name, r in results.items()}
    print()
    for name, r in results.items():
        print(f"{name}: steady iteration {steady[name]:.2f} s (train stage {train[name]:.2f} s, of it the update "
              f"{update[name]:.2f} s), whole command {r['wall']:.1f} s; trainer state {r['state_bytes'] / 1e9:.3f} GB, "
              f"run directory at the end {r['run_bytes'] / 1e9:.3f} GB")
    print()
    if "saving off" in results:
        for name in (n for n in results if n != "saving off"):
            print(f"steady iteration, {name} / saving off = {steady[name] / steady['saving off']:.3f}x (target <= 1.1x); "
                  f"whole command {results[name]['wall'] / results['saving off']['wall']:.3f}x")


if __name__ == "__main__":
    main()
