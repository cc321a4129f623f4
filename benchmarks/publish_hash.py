"""Claim: committing a trainer state hashes its bytes once, in parallel. An iteration publishes the
train step's state (``ArtifactStore.handle``: ``sha256_tree``) and then commits it as a checkpoint
(``tasks.save``: hard links plus a manifest of every file's sha256). Before, both hashed every file
in one thread, so the state's bytes were read and hashed twice: 44 GB per iteration at the medium
preset (22 GB of bf16 weights, fp32 master weights and moments), where the H200 loop's save ran past
80 s. Now ``published_sha256`` hashes in ``HASH_WORKERS`` threads and the commit takes a linked
file's digest by inode.

Same run, same files (DCP-like: a few large shards), page cache warm (what the train step just wrote
is usually still cached; the O_DIRECT writer's is not, and then each avoided read is a disk read):

    baseline   sequential sha256 of every file, twice (the old handle + the old commit)
    now        k3core.artifacts.sha256_tree, then published_sha256 over hard links of the files

    python benchmarks/publish_hash.py [--gib 2] [--files 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3core import artifacts  # noqa: E402


def _sequential(files: list[Path]) -> list[str]:
    out = []
    for p in files:
        h = hashlib.sha256()
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        out.append(h.hexdigest())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3rl-publish-hash-", dir=a.dir))
    try:
        state = work / "state"
        state.mkdir()
        per = int(a.gib * 2**30 / a.files)
        block = os.urandom(16 << 20)
        for i in range(a.files):
            with open(state / f"__{i}_0.distcp", "wb") as f:
                for _ in range(per // len(block)):
                    f.write(block)
        files = sorted(state.iterdir())
        total = sum(p.stat().st_size for p in files)
        _sequential(files)  # warm the page cache for both rows
        base, now = [], []
        for r in range(a.repeat):
            t0 = time.perf_counter()
            want = _sequential(files)
            assert _sequential(files) == want
            base.append(time.perf_counter() - t0)
            artifacts._published_digests.clear()  # a fresh process's memo
            ckpt = work / f"ckpt{r}"
            ckpt.mkdir()
            t0 = time.perf_counter()
            artifacts.sha256_tree(state)
            links = []
            for p in files:
                os.link(p, ckpt / p.name)
                links.append(ckpt / p.name)
            got = artifacts.published_sha256(links)
            now.append(time.perf_counter() - t0)
            assert got == want
        b, n = statistics.median(base), statistics.median(now)
        print(f"{len(files)} files, {total / 2**30:.2f} GiB, page cache warm, {os.cpu_count()} CPUs, "
              f"HASH_WORKERS {artifacts.HASH_WORKERS}; medians of {a.repeat}")
        print(f"{'row':<48}{'seconds':>9}{'GiB/s of state':>16}")
        print(f"{'baseline: sequential sha256, handle + commit':<48}{b:>9.2f}{total / 2**30 / b:>16.2f}")
        print(f"{'now: sha256_tree (threads) + commit by inode':<48}{n:>9.2f}{total / 2**30 / n:>16.2f}")
        print(f"speed-up {b / n:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
