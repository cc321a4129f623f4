"""Claim: a scheduled tick (``rl_continue``, one more iteration) costs the same at tick N as at tick 2,
because a continued run does not replay its finished iterations.

Baseline, measured in the same run: the same tick with the run's ``lineage.json`` removed first, which
makes ``rl_run`` replay every finished iteration through Prefect's cache (every past subflow, every
weight transfer, the cached evaluations), as ticks did before the run recorded its iterations.

    python benchmarks/continue_ticks.py --ticks 6        # tiny preset, Prefect embedded mode

Prints, per tick, the RL iterations the tick ran (``rl_iteration`` subflows: 1 is the new one, the
rest replayed), its seconds and the growth of Prefect's database (a fresh ``PREFECT_HOME``, SQLite),
for both, and the ratio tick N / tick 2. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# a fresh Prefect home, so the database growth measured is this benchmark's alone
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="k3rl-ticks-prefect-"))
import flows  # noqa: F401,E402  (sets Prefect's environment before it is imported)
import flows.pipeline as pipeline  # noqa: E402
from flows.deploy import rl_continue  # noqa: E402
from k3core.settings import RLSettings  # noqa: E402
from k3core.rl import engines, trainers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ticks", type=int, default=6)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = tempfile.mkdtemp(prefix="k3rl-ticks-")
    home = Path(os.environ["PREFECT_HOME"])

    def db_bytes() -> int:  # the database and its write-ahead log
        return sum(p.stat().st_size for p in home.glob("prefect.db*"))

    tiny = RLSettings.from_dict(dict(preset="tiny", env="reverse", prompts_per_iteration=4, samples_per_prompt=4,
                                     max_new_tokens=4, warmup_steps=2, warmup_batch=4, eval_prompts=8, eval_every=2,
                                     mismatch_sequences=4))
    subflows = [0]
    real_iteration = pipeline.rl_iteration

    def counted(*args, **kwargs):
        subflows[0] += 1
        return real_iteration(*args, **kwargs)

    pipeline.rl_iteration = counted  # rl_run looks the flow up at call time
    rows = []
    for mode in ("continue", "replay"):
        run_id = f"ticks-{mode}"
        secs, its, grow = [], [], []
        for _ in range(a.ticks):
            lineage = Path(root) / "runs" / run_id / "lineage.json"
            if mode == "replay" and lineage.exists():
                lineage.unlink()  # the run has no record of its iterations: it replays them
            engines.clear()  # every tick is a fresh process on a worker
            trainers.clear()
            subflows[0] = 0
            t0, b0 = time.perf_counter(), db_bytes()
            rl_continue(run_id=run_id, artifacts=root, iterations_per_tick=1, settings=tiny)
            secs.append(time.perf_counter() - t0)
            its.append(subflows[0])
            grow.append(db_bytes() - b0)
        rows.append((mode, secs, its, grow))
    print(f"per tick (tiny preset, one new iteration per tick, artifacts in {root}):")
    for mode, secs, its, grow in rows:
        print(f"  {mode:<9} iterations run " + " ".join(f"{x:5d}" for x in its))
        print(f"  {'':<9} seconds        " + " ".join(f"{x:5.1f}" for x in secs)
              + f"   tick {a.ticks} / tick 2: {secs[-1] / secs[1]:.2f}x")
        print(f"  {'':<9} database KiB   " + " ".join(f"{x / 1024:5.0f}" for x in grow)
              + f"   tick {a.ticks} / tick 2: {grow[-1] / max(grow[1], 1):.2f}x")
    cont, replay = rows[0][1], rows[1][1]
    print(f"tick {a.ticks}: replay / continue = {replay[-1] / cont[-1]:.2f}x")


if __name__ == "__main__":
    main()
