"""Weight transfer throughput per path (k3core.transfer) against a plain memcpy of the same bytes.

Claims (issue 7, benchmarks): the in-process path reaches >= 50% of a memcpy of the same bytes, and
the in-memory paths are >= 10x the disk path. All rows in one run, on the same state.

States: the ``small`` preset, and a synthetic ~1 GiB K3 (the small preset's shapes with more routed
experts), both bf16 (so the disk path's public layout carries the very same bytes as the in-memory
paths; the release's fp32 tensors stay fp32 everywhere).

Rows (GB/s = bytes that moved / wall seconds; "vs memcpy" and "vs disk" are ratios of GB/s):
  memcpy            ``dst.copy_(src)`` of one flat buffer holding as many bytes (the baseline)
  inprocess         ``push_inprocess`` into a ``RolloutEngine`` in this process, without digests
                    (``algo="none"``), with xxh3-128 digests (when ``xxhash`` is installed), with sha256
  shm streamed      ``send_shm_stream`` here -> ``load_payload`` in a receiver process: a ring of
                    ``--ring`` buckets of ``--stream-bucket-mib``, the receiver copying bucket i-1 into
                    its staged copy while the sender fills bucket i, verifying every digest, then
                    ``load_weights``; wall time from the first byte to the receiver's "done"
  *, kept staging   the same with the receiver's staged tensors kept across transfers
                    (``load_payload(..., staging=dict)``: fresh pages cost more to fault in than the copy)
  peak /dev/shm     (shm rows) most bytes this process's k3xfer segments held in /dev/shm, sampled
                    every ~2 ms during the timed transfers
  cuda_ipc          (``--device cuda``) ``send_cuda_ipc`` -> ``load_payload``: CUDA IPC buckets of
                    ``--bucket-mib``, ``sum64`` digests on the GPU; wall time from the first byte to the
                    receiver's answer
  disk              ``write_disk`` (public layout, fsync'ed, published) + ``read_disk`` (digests checked)
                    + ``load_weights``; the read hits the page cache the write just filled
  *, MXFP4          (small preset only) routed experts re-quantised to MXFP4 on the way: GB/s over
                    the MXFP4 bytes that moved; on CPU the quantiser, not the copy, sets the pace

Usage:
    python benchmarks/weight_transfer.py                  # small preset + ~1 GiB synthetic, 3 repeats
    python benchmarks/weight_transfer.py --quick          # small preset only, 1 repeat
    python benchmarks/weight_transfer.py --device cuda    # GPU: memcpy on device, in-process, CUDA IPC, disk
    python benchmarks/weight_transfer.py --ring 2 --stream-bucket-mib 32   # another streamed ring
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3core.config import K3Config  # noqa: E402

GiB = 1 << 30


# ------------------------------------------------------------------ states and engines
def synthetic_config(target_bytes: int) -> K3Config:
    """The small preset with as many routed experts as make ~``target_bytes`` of bf16 weights."""
    from k3core.checkpoint.names import native_shapes

    base = K3Config.preset("small")
    shapes = native_shapes(base)
    expert = sum(torch.Size(s).numel() for k, s in shapes.items() if k.endswith((".experts.w13", ".experts.w2")))
    other = sum(torch.Size(s).numel() for k, s in shapes.items()) - expert
    per_expert = expert // base.num_experts
    n = max(base.num_experts, int((target_bytes / 2 - other) // per_expert))
    return base.replace(num_experts=n)


def blank_model(config: K3Config, dtype: torch.dtype, device: str):
    from k3core.checkpoint.names import materialize, meta_model

    model = materialize(meta_model(config), device).cast(dtype)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.zero_()
    return model


def random_model(config: K3Config, dtype: torch.dtype, device: str, seed: int = 0):
    """Random weights, filled one tensor at a time (no model-sized temporaries)."""
    model = blank_model(config, dtype, device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0, 0.02, generator=g)
    return model


def blank_engine(config: K3Config, dtype: torch.dtype, device: str, quantized: bool = False):
    from k3core.rl.weights import engine_from_model

    return engine_from_model(blank_model(config, dtype, device), -1, quantized)


def perturb(model) -> None:
    """A new version: every tensor changes (the full-fine-tuning case)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)


# ------------------------------------------------------------------ receiver process
def serve_receiver() -> None:
    """``--serve-receiver``: one JSON line of setup, then one payload per line; answers each."""
    from k3core.transfer import TransferError, load_payload

    setup = json.loads(sys.stdin.readline())
    torch.set_num_threads(setup["threads"])
    config = K3Config.from_hf_dict(setup["config"])
    engines, stagings = {}, {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        key = (req["quantized"],)
        if key not in engines:
            engines[key] = blank_engine(config, getattr(torch, setup["dtype"]), setup["device"], req["quantized"])
        t0 = time.perf_counter()
        try:
            staging = stagings.setdefault(key, {}) if req.get("keep_staging") else None
            version = load_payload(engines[key], req["payload"], staging=staging)
            out = {"ok": True, "version": version}
        except TransferError as e:
            out = {"ok": False, "error": str(e)}
        out["seconds"] = time.perf_counter() - t0
        print(json.dumps(out), flush=True)


class Receiver:
    def __init__(self, config: K3Config, dtype: torch.dtype, device: str):
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-receiver"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.ask({"config": config.to_hf_dict(), "dtype": str(dtype).removeprefix("torch."), "device": device,
                  "threads": torch.get_num_threads()})

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("receiver process died")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------ rows
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_memcpy(nbytes: int, device: str, repeats: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of every page, outside the timing
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    del src, dst
    return times


class ShmPeak:
    """Most bytes of /dev/shm (tmpfs pages actually allocated, not file sizes) held by this process's
    transfer segments created while the ``with`` block runs (segments from earlier rows do not count)."""

    def __init__(self, every_s: float = 0.002):
        from k3core.transfer import SHM_PREFIX, live_segments
        from k3core.transfer.segments import SHM_DIR

        self.prefix, self.live, self.dir, self.every_s = f"{SHM_PREFIX}{os.getpid()}-", live_segments, SHM_DIR, every_s
        self.peak, self._stop = 0, threading.Event()

    def _held(self) -> int:
        total = 0
        for n in self.live(self.prefix):
            if n not in self._before:
                try:
                    total += os.stat(os.path.join(self.dir, n)).st_blocks * 512
                except FileNotFoundError:
                    pass
        return total

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._held())
            time.sleep(self.every_s)

    def __enter__(self) -> ShmPeak:
        self._before = set(self.live(self.prefix))
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._held())


class Versions:
    def __init__(self):
        self.v = 0

    def next(self) -> int:
        self.v += 1
        return self.v


def run_state(label: str, config: K3Config, dtype: torch.dtype, device: str, repeats: int, bucket_bytes: int,
              quantized_rows: bool, tmp: Path, ring: int, stream_bucket_bytes: int) -> list[dict]:
    from k3core import transfer as T

    rows: list[dict] = []
    trainer = random_model(config, dtype, device)
    state = trainer.state_dict()
    nbytes = T.wire_nbytes(state)
    versions = Versions()

    def add(name: str, times: list[float], moved: int, note: str = "", shm_peak: int | None = None) -> None:
        rows.append({"state": label, "path": name, "bytes": moved, "times": times, "note": note, "shm_peak": shm_peak})
        med = statistics.median(times)
        peak = f"  peak /dev/shm {shm_peak / 2**20:7.1f} MiB" if shm_peak is not None else ""
        print(f"  {label:>10} {name:<32} {moved / 2**20:9.1f} MiB  median {med * 1e3:9.1f} ms  "
              f"{moved / med / 1e9:7.3f} GB/s{peak}", flush=True)

    add("memcpy", time_memcpy(nbytes, device, repeats), nbytes)

    # in-process
    eng = blank_engine(config, dtype, device)
    algos = ["none"] + [a for a in ("xxh3_128", "sha256", "sum64") if a in T.available_algos()
                        and (device == "cuda" or a != "sum64")]
    T.push_inprocess(eng, state, versions.next(), algo="none")  # first touch of the engine's pages: not timed
    for algo in algos:
        times = []
        for _ in range(repeats):
            perturb(trainer)
            sync(device)
            t0 = time.perf_counter()
            rep = T.push_inprocess(eng, state, versions.next(), algo=algo)
            sync(device)
            times.append(time.perf_counter() - t0)
        add(f"inprocess ({'no digest' if algo == 'none' else algo})", times, rep.bytes_sent)
    del eng

    # another process: the shared-memory stream (CPU or GPU tensors), CUDA IPC on GPU
    recv = Receiver(config, dtype, device)

    def send(state, name: str, streamed: bool, quantize_experts: bool = False, keep_staging: bool = False):
        """One transfer of ``state`` to the receiver; (the sender's report, the receiver's seconds)."""
        if streamed:
            sent = T.send_shm_stream(state, versions.next(), ring=ring, bucket_bytes=stream_bucket_bytes,
                                     quantize_experts=quantize_experts)
        else:
            sent = T.send_cuda_ipc(state, versions.next(), bucket_bytes=bucket_bytes, quantize_experts=quantize_experts)
        with sent:
            r = recv.ask({"payload": sent.payload, "quantized": quantize_experts, "keep_staging": keep_staging})
            if not r["ok"]:
                raise RuntimeError(f"{name} transfer refused: {r['error']}")
            return (sent.wait() if streamed else sent.report), r["seconds"]

    try:
        transports = [("cuda_ipc", False, False)] if device == "cuda" else []
        transports += [("shm streamed", True, False), ("shm streamed, kept staging", True, True)]
        for name, streamed, keep in transports:
            times, recv_s = [], []
            with ShmPeak() as peak:
                for i in range(repeats + 1):  # the first builds the receiver's engine and staging: not timed
                    perturb(trainer)
                    sync(device)
                    t0 = time.perf_counter()
                    rep, seconds = send(state, name, streamed, keep_staging=keep)
                    if i:
                        times.append(time.perf_counter() - t0)
                        recv_s.append(seconds)
            shape = f"ring {ring} x {stream_bucket_bytes >> 20} MiB, " if streamed else ""
            add(f"{name} ({rep.hash}, {shape}{rep.buckets} buckets)", times, rep.bytes_sent,
                f"receiver ({'stream + ' if streamed else ''}verify + load) {statistics.median(recv_s) * 1e3:.0f} ms",
                shm_peak=peak.peak if streamed else None)
        if quantized_rows:
            times = []
            for i in range(repeats + 1):
                perturb(trainer)
                t0 = time.perf_counter()
                rep, _ = send(state, "shm streamed MXFP4", True, quantize_experts=True, keep_staging=True)
                if i:
                    times.append(time.perf_counter() - t0)
            add("shm streamed, MXFP4 experts", times, rep.bytes_sent, "quantiser-bound")
    finally:
        recv.close()

    if quantized_rows:
        qeng = blank_engine(config, dtype, device, quantized=True)
        times = []
        for _ in range(repeats):
            perturb(trainer)
            sync(device)
            t0 = time.perf_counter()
            rep = T.push_inprocess(qeng, state, versions.next(), quantize_experts=True, algo="none")
            sync(device)
            times.append(time.perf_counter() - t0)
        add("inprocess, MXFP4 experts", times, rep.bytes_sent, "quantiser-bound")
        del qeng

    # disk
    eng = blank_engine(config, dtype, device)
    times, wt, rt = [], [], []
    for _ in range(repeats):
        perturb(trainer)
        sync(device)
        t0 = time.perf_counter()
        rep = T.write_disk(tmp / label, trainer, config, versions.next())
        t1 = time.perf_counter()
        sd, version = T.read_disk(tmp / label, current_version=eng.weight_version)
        eng.load_weights(sd, version)
        del sd
        sync(device)
        t2 = time.perf_counter()
        times.append(t2 - t0)
        wt.append(t1 - t0)
        rt.append(t2 - t1)
    add("disk (write + read + load)", times, rep.bytes_sent,
        f"write {statistics.median(wt) * 1e3:.0f} ms, read+load {statistics.median(rt) * 1e3:.0f} ms")
    shutil.rmtree(tmp / label, ignore_errors=True)
    del eng, trainer, state
    return rows


def table(rows: list[dict]) -> str:
    out = ["| state | path | MiB moved | median ms | best ms | GB/s (median) | vs memcpy | vs disk | peak /dev/shm MiB | note |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    by_state: dict[str, list[dict]] = {}
    for r in rows:
        by_state.setdefault(r["state"], []).append(r)
    for state, rs in by_state.items():
        gbps = {r["path"]: r["bytes"] / statistics.median(r["times"]) / 1e9 for r in rs}
        mem = gbps["memcpy"]
        disk = next(v for k, v in gbps.items() if k.startswith("disk"))
        for r in rs:
            g = gbps[r["path"]]
            peak = f"{r['shm_peak'] / 2**20:.1f}" if r.get("shm_peak") is not None else ""
            out.append(f"| {state} | {r['path']} | {r['bytes'] / 2**20:.1f} | {statistics.median(r['times']) * 1e3:.1f} | "
                       f"{min(r['times']) * 1e3:.1f} | {g:.3f} | {g / mem:.2f}x | {g / disk:.1f}x | {peak} | {r['note']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small preset only, 1 repeat")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--large-gib", type=float, default=1.0, help="size of the synthetic state (0: skip it)")
    ap.add_argument("--bucket-mib", type=int, default=256, help="CUDA IPC: bytes per bucket")
    ap.add_argument("--ring", type=int, default=3, help="streamed path: buckets in the shared-memory ring")
    ap.add_argument("--stream-bucket-mib", type=int, default=16, help="streamed path: bytes per ring bucket")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--dir", default=None, help="where the disk path writes (default: a temp dir under /tmp)")
    ap.add_argument("--serve-receiver", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_receiver:
        serve_receiver()
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    from k3core.transfer import available_algos, default_algo

    repeats = args.repeats or (1 if args.quick else 3)
    states = [("small", K3Config.preset("small"), True)]
    if not args.quick and args.large_gib > 0:
        states.append((f"{args.large_gib:g}GiB-syn", synthetic_config(int(args.large_gib * GiB)), False))
    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()}-core CPU"
    print(f"# weight transfer, {dev}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"digests available {available_algos()} (CPU default {default_algo('cpu')}), repeats {repeats}, "
          f"bucket {args.bucket_mib} MiB, streamed ring {args.ring} x {args.stream_bucket_mib} MiB", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="k3-weight-transfer-") as tmp:
        for label, config, quantized_rows in states:
            print(f"## {label}: {config.num_experts} experts", flush=True)
            rows += run_state(label, config, torch.bfloat16, args.device, repeats, args.bucket_mib << 20,
                              quantized_rows, Path(tmp), args.ring, args.stream_bucket_mib << 20)
    print()
    print(table(rows))
    print()
    for state in dict.fromkeys(r["state"] for r in rows):
        rs = {r["path"]: r["bytes"] / statistics.median(r["times"]) / 1e9 for r in rows if r["state"] == state}
        mem, disk = rs["memcpy"], next(v for k, v in rs.items() if k.startswith("disk"))
        for k, v in rs.items():
            if k.startswith("inprocess ("):
                print(f"{state}: {k} {v / mem:.0%} of memcpy (target >= 50%: {'met' if v >= 0.5 * mem else 'MISSED'})")
        for k, v in rs.items():
            if k.startswith(("inprocess (", "shm", "cuda_ipc (")) and "MXFP4" not in k:
                print(f"{state}: {k} {v / disk:.1f}x disk (target >= 10x: {'met' if v >= 10 * disk else 'MISSED'})")

if __name__ == "__main__":
    main()
