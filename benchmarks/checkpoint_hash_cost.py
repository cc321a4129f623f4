"""Checkpoint hash cost: what checking a checkpoint's sha256 manifest adds, against reading the same
bytes, and against a whole load, in the same run.

Claim (issue 23, item 4): checking the manifest costs about one more sequential read of the
checkpoint's files at sha256 speed; it is measured here so the price of "every load checks it" is a
figure, not a guess.

Rows (page cache warm: every row reads bytes the previous rows read). The rows are measured round
robin, one of each per round, so load on a shared machine hits them alike; each ratio is the median
over rounds of that round's ratio:
  read              every file of the checkpoint read in 8 MiB chunks, bytes dropped (the baseline)
  sha256            the same files through k3core.checkpoint.files.sha256_file (same chunk size)
  verify_manifest   k3core.checkpoint.manifest.verify_manifest (sizes, then sha256, 4 threads)
  load_unchecked    load_model of a copy with its manifest removed (a checkpoint from elsewhere)
  load_checked      load_model of the checkpoint itself (the manifest verified first)

Ratios printed: sha256 / read, verify_manifest / read, verify_manifest / load_unchecked (what the
check adds to a load, from two rows that each take the time they take), load_checked /
load_unchecked (the same thing measured directly: noisier, a difference of two loads).

Usage:
    python benchmarks/checkpoint_hash_cost.py                  # the `small` preset, bf16
    python benchmarks/checkpoint_hash_cost.py --preset tiny --repeat 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def read_all(files: list[Path], chunk: int) -> int:
    buf = bytearray(chunk)
    n = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    return n


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    a = ap.parse_args()

    import torch

    from k3core.checkpoint.files import HASH_CHUNK, sha256_file
    from k3core.checkpoint.hf import init_checkpoint, load_model
    from k3core.checkpoint.manifest import MANIFEST_NAME, verify_manifest

    torch.set_num_threads(2)
    root = Path(a.dir or tempfile.mkdtemp(prefix="hash-cost-"))
    try:
        ck, bare = root / "ck", root / "bare"
        init_checkpoint(a.preset, ck, seed=0)
        shutil.copytree(ck, bare)
        (bare / MANIFEST_NAME).unlink()
        files = sorted(p for p in ck.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
        nbytes = sum(p.stat().st_size for p in files)
        read_all(files, HASH_CHUNK)  # warm the page cache for every row alike
        fns = {
            "read": lambda: read_all(files, HASH_CHUNK),
            "sha256": lambda: [sha256_file(p) for p in files],
            "verify_manifest": lambda: verify_manifest(ck, required=True),
            "load_unchecked": lambda: load_model(bare, dtype=torch.float32),
            "load_checked": lambda: load_model(ck, dtype=torch.float32),
        }
        rounds = [{name: timed(fn) for name, fn in fns.items()} for _ in range(a.repeat)]
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mib = nbytes / 2**20

    def ratio(a_: str, b_: str) -> float:
        return statistics.median(r[a_] / r[b_] for r in rounds)
    print(f"preset {a.preset}: {len(files)} files, {mib:.1f} MiB, {a.repeat} rounds, page cache warm")
    for name in fns:
        t = statistics.median(r[name] for r in rounds)
        print(f"  {name:16s} {t * 1e3:9.1f} ms  {mib / t:9.1f} MiB/s  (median)")
    print(f"sha256 / read                  {ratio('sha256', 'read'):.2f}x")
    print(f"verify_manifest / read         {ratio('verify_manifest', 'read'):.2f}x")
    print(f"verify_manifest / load_unchecked {ratio('verify_manifest', 'load_unchecked'):.2f}x")
    print(f"load_checked / load_unchecked  {ratio('load_checked', 'load_unchecked'):.2f}x")


if __name__ == "__main__":
    main()
