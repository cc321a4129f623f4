"""Checkpoint hash cost: what checking a checkpoint's sha256 manifest adds, against reading the same
bytes, and against a whole load, in the same run.

Claim (issue 23, item 4): checking the manifest costs about one more sequential read of the
checkpoint's files at sha256 speed; it is measured here so the price of "every load checks it" is a
figure, not a guess.

Rows (medians of --repeat runs, page cache warm: every row reads bytes the previous rows read):
  read              every file of the checkpoint read in 8 MiB chunks, bytes dropped (the baseline)
  sha256            the same files through k3core.checkpoint.files.sha256_file (same chunk size)
  verify_manifest   k3core.checkpoint.manifest.verify_manifest (sizes, then sha256, 4 threads)
  load_unchecked    load_model of a copy with its manifest removed (a checkpoint from elsewhere)
  load_checked      load_model of the checkpoint itself (the manifest verified first)

Ratios printed: sha256 / read, verify_manifest / read, load_checked / load_unchecked.

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


def timed(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


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
        rows = {
            "read": timed(lambda: read_all(files, HASH_CHUNK), a.repeat),
            "sha256": timed(lambda: [sha256_file(p) for p in files], a.repeat),
            "verify_manifest": timed(lambda: verify_manifest(ck, required=True), a.repeat),
            "load_unchecked": timed(lambda: load_model(bare, dtype=torch.float32), a.repeat),
            "load_checked": timed(lambda: load_model(ck, dtype=torch.float32), a.repeat),
        }
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mib = nbytes / 2**20
    print(f"preset {a.preset}: {len(files)} files, {mib:.1f} MiB, median of {a.repeat}, page cache warm")
    for name, t in rows.items():
        print(f"  {name:16s} {t * 1e3:9.1f} ms  {mib / t:9.1f} MiB/s")
    print(f"sha256 / read                  {rows['sha256'] / rows['read']:.2f}x")
    print(f"verify_manifest / read         {rows['verify_manifest'] / rows['read']:.2f}x")
    print(f"load_checked / load_unchecked  {rows['load_checked'] / rows['load_unchecked']:.2f}x "
          f"(+{(rows['load_checked'] - rows['load_unchecked']) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
