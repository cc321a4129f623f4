"""Checkpoint write: stock DCP FileSystemWriter vs ODirectFileSystemWriter, same state dict, same run.

Claim (issue 5, section 4): on a disk-bound machine the O_DIRECT writer is >= 1.3x the stock
writer, within 15% of the raw O_DIRECT limit of the disk (`dd if=/dev/zero oflag=direct` of the
same bytes), and grows the page cache by <= 64 MiB whatever the checkpoint size (the stock writer
leaves the whole checkpoint in it).

Rows:
  serialize-only   torch.save of every item into a sink that drops the bytes: the CPU ceiling
                   (torch.save's CRC32 dominates; it is the same for both writers)
  dd-direct        dd if=/dev/zero oflag=direct bs=<buffer> conv=fsync, same byte count: the
                   disk's limit
  stock            dcp.save(..., FileSystemWriter(dir))              (fsyncs, like ours)
  odirect          dcp.save(..., ODirectFileSystemWriter(dir, ...))

Page-cache growth: `Cached + Dirty` from /proc/meminfo after `sync`, before and after each run
(dropping caches needs root; each run's files are deleted afterwards, which evicts their pages).
On a shared machine other processes move these counters too: read small values as "about zero".

Usage:
    python benchmarks/checkpoint_write.py                 # 4 GiB where disk and RAM allow
    python benchmarks/checkpoint_write.py --quick         # 512 MiB
    python benchmarks/checkpoint_write.py --dir /local/nvme/bench --size-gib 16 --repeat 2
    python benchmarks/checkpoint_write.py --device cuda   # state dict on the GPU (D2H included)
Needs only torch (and coreutils dd for the raw row).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3core.checkpoint.odirect import ODirectFileSystemWriter, is_memory_filesystem  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
warnings.filterwarnings("ignore", "torch.distributed is disabled")


def meminfo_kib(*fields: str) -> int:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, rest = line.split(":", 1)
        values[name] = int(rest.split()[0])
    return sum(values[f] for f in fields)


def page_cache_bytes() -> int:
    return meminfo_kib("Cached", "Dirty") * 1024


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, typ, *_ = line.split()
        if str(path).startswith(mnt) and len(mnt) > len(best):
            best, kind = mnt, typ
    return f"{kind} ({best})"


def make_state(total: int, tensor_bytes: int, device: str) -> dict[str, torch.Tensor]:
    """Tensors of ~tensor_bytes, alternating fp32 / bf16, each a few elements off any 4 KiB
    multiple; random contents (nothing on the path compresses, but stay honest anyway)."""
    state, left, i = {}, total, 0
    while left > 0:
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        nbytes = min(left, tensor_bytes)
        numel = max(1, nbytes // dtype.itemsize - 7)
        t = torch.empty(numel, dtype=dtype, device=device)
        t.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).random_()
        state[f"layers.{i}.weight"] = t
        left -= numel * dtype.itemsize
        i += 1
    return state


class _Sink(io.RawIOBase):
    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n

    def tell(self) -> int:
        return self.n


def run_serialize_only(threads: int):
    def run(state: dict, _: Path) -> int:
        tensors = list(state.values())
        sinks = [_Sink() for _ in range(threads)]

        def work(i: int) -> None:
            for t in tensors[i::threads]:
                torch.save(t.cpu(), sinks[i])

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return sum(s.n for s in sinks)
    return run


def run_dd(nbytes: int, bs: int):
    def run(_: dict, out: Path) -> int:
        out.mkdir(parents=True, exist_ok=True)
        count = -(-nbytes // bs)
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={out / 'dd.bin'}", "oflag=direct", f"bs={bs}",
             f"count={count}", "conv=fsync", "status=none"],
            check=True,
        )
        return count * bs
    return run


def run_writer(make_writer):
    def run(state: dict, out: Path) -> int:
        dcp.save(state, storage_writer=make_writer(out))
        return sum(p.stat().st_size for p in out.iterdir() if p.suffix == ".distcp")
    return run


def measure(name: str, fn, state: dict, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    before = page_cache_bytes()
    t0 = time.perf_counter()
    nbytes = fn(state, out)
    seconds = time.perf_counter() - t0
    os.sync()
    growth = page_cache_bytes() - before
    shutil.rmtree(out, ignore_errors=True)
    return {"name": name, "bytes": nbytes, "seconds": seconds, "growth": growth}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--quick", action="store_true", help="512 MiB smoke run")
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[1] / "build" / "bench_ckpt")
    p.add_argument("--tensor-mib", type=int, default=256, help="size of one state-dict tensor")
    p.add_argument("--buffer-mib", type=int, default=16)
    p.add_argument("--num-buffers", type=int, default=None, help="default: 2 * thread_count + 2")
    p.add_argument("--io-threads", type=int, default=1)
    p.add_argument("--thread-count", type=int, default=1,
                   help="serialising threads (= files) per rank, for both writers; torch.save's "
                        "CRC32 runs at ~2 GB/s per core, so a fast NVMe needs several")
    p.add_argument("--repeat", type=int, default=3, help="rounds; the order of the runs rotates")
    p.add_argument("--device", default="cpu")
    p.add_argument("--skip-dd", action="store_true")
    args = p.parse_args()

    size = int((0.5 if args.quick else args.size_gib) * GiB)
    args.dir.mkdir(parents=True, exist_ok=True)
    free_disk = shutil.disk_usage(args.dir).free
    free_ram = meminfo_kib("MemAvailable") * 1024
    limit = min(int(free_disk * 0.8), int(free_ram * 0.4) if args.device == "cpu" else free_disk)
    if size > limit:
        print(f"# size reduced from {size / GiB:.2f} GiB to {limit / GiB:.2f} GiB (free disk/RAM)")
        size = limit // MiB * MiB

    print(f"# dir {args.dir}: {fs_type(args.dir.resolve())}; tmpfs={is_memory_filesystem(args.dir)}")
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs, device {args.device}")
    state = make_state(size, args.tensor_mib * MiB, args.device)
    payload = sum(t.numel() * t.element_size() for t in state.values())
    bs = args.buffer_mib * MiB
    if args.num_buffers is None:
        args.num_buffers = 2 * args.thread_count + 2
    print(f"# state: {len(state)} tensors, {payload / GiB:.3f} GiB; odirect pool "
          f"{args.num_buffers} x {args.buffer_mib} MiB, {args.io_threads} I/O thread(s); "
          f"thread_count={args.thread_count} for both writers")

    runs = {
        "serialize-only": run_serialize_only(args.thread_count),
        "stock": run_writer(lambda d: FileSystemWriter(d, thread_count=args.thread_count)),
        "odirect": run_writer(
            lambda d: ODirectFileSystemWriter(
                d, buffer_bytes=bs, num_buffers=args.num_buffers, io_threads=args.io_threads,
                thread_count=args.thread_count,
            )
        ),
    }
    if not args.skip_dd and shutil.which("dd"):
        runs["dd-direct"] = run_dd(payload, bs)
    names = list(runs)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeat):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            try:
                m = measure(name, runs[name], state, args.dir / name)
            except subprocess.CalledProcessError as e:
                print(f"# {name} failed: {e}")
                continue
            print(f"# round {r} {name}: {m['bytes'] / GiB:.3f} GiB in {m['seconds']:.2f} s "
                  f"({m['bytes'] / GiB / m['seconds']:.3f} GiB/s), page cache "
                  f"{m['growth'] / MiB:+.0f} MiB", flush=True)
            results[name].append(m)
    results = {n: ms for n, ms in results.items() if ms}

    def rate(m: dict) -> float:
        return m["bytes"] / GiB / m["seconds"]

    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2

    med = {n: median([rate(m) for m in ms]) for n, ms in results.items()}
    best = {n: max(rate(m) for m in ms) for n, ms in results.items()}
    growth = {n: median([m["growth"] for m in ms]) for n, ms in results.items()}

    def paired(a: str, b: str) -> str:
        """Median over rounds of a/b measured in the same round (the disk drifts over minutes)."""
        if a not in results or b not in results:
            return "-"
        pairs = [rate(x) / rate(y) for x, y in zip(results[a], results[b])]
        return f"{median(pairs):.2f}x"

    print()
    print(f"{args.repeat} round(s); GiB/s as median (best); ratios: median over rounds of the "
          "same-round ratio")
    print()
    print("| writer | GiB | GiB/s median (best) | vs stock | vs dd-direct | page-cache growth MiB (median) |")
    print("|---|---|---|---|---|---|")
    for name in ["serialize-only", "dd-direct", "stock", "odirect"]:
        if name not in results:
            continue
        g = "-" if name == "serialize-only" else f"{growth[name] / MiB:+.0f}"
        print(f"| {name} | {results[name][0]['bytes'] / GiB:.3f} | {med[name]:.3f} ({best[name]:.3f}) | "
              f"{paired(name, 'stock')} | {paired(name, 'dd-direct')} | {g} |")
    print()
    if {"stock", "odirect"} <= set(results):
        print(f"odirect / stock           = {paired('odirect', 'stock')}   (target >= 1.3x where disk-bound)")
    if {"dd-direct", "odirect"} <= set(results):
        print(f"odirect / dd-direct       = {paired('odirect', 'dd-direct')}   (target >= 0.85x)")
        if "serialize-only" in results:
            print(f"disk-bound (dd-direct < serialize-only): {med['dd-direct'] < med['serialize-only']}")
    if "odirect" in results:
        print(f"odirect page-cache growth = {growth['odirect'] / MiB:+.0f} MiB   (target <= 64 MiB)")

if __name__ == "__main__":
    main()
