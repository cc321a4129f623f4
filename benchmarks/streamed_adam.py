"""StreamedAdamW vs the full-gradient-buffer offload baseline: host bytes/param, step time, PCIe, CPU throughput.

Claims measured (issue 6):
  1. host memory: StreamedAdamW holds <= 8 B/param + fixed chunk buffers (RSS and pinned bytes);
     the baseline ~12 B/param.
  2. step time on one GPU with >= 1B parameters: <= 1.1x the baseline; PCIe GB/s achieved by the
     chunk copies vs the pinned-copy bandwidth measured in the same run.
  3. host update throughput (parameters/s) vs torch.optim.AdamW(foreach=True) and (fused=True),
     and against the host's memory bandwidth (a 1 GiB copy in the same run): the bf16-moment
     update moves 20 B/param (bf16 grad, moments and weight, fp32 master), so bandwidth / 20 B
     bounds it. Rows for both host paths: the C kernel (k3core.optim.host_kernel) and the torch
     path (tile by tile through torch's fused kernel).

Named baseline, "full-buffer offload": how torchao's CPUOffloadOptimizer, DeepSpeed ZeRO-Offload and
Megatron's HybridDeviceOptimizer work: one device -> host copy of every gradient into a
parameter-sized fp32 host buffer (cast on the device, 4 B/param over PCIe), then the host update,
then every updated weight host -> device (bf16, 2 B/param, staged in the consumed gradient buffer
so the baseline needs no extra buffer). Its host update is StreamedAdamW's own (same chunked fused
kernel, same bf16 moments with stochastic rounding), so the difference measured is the buffer and
the missing overlap, not the update arithmetic.

Each variant runs in a fresh subprocess so its peak RSS is its own (VmHWM reset after the model
and gradients exist). Workload: bf16 [H, H] matrices up to --params elements, plus fp32 [H]
vectors (like KDA's A_log/dt_bias) and bf16 [H] norms; random bf16 gradients; clipping on.

    python benchmarks/streamed_adam.py --quick                 # CPU smoke run
    python benchmarks/streamed_adam.py                         # CPU, 64M parameters
    python benchmarks/streamed_adam.py --device cuda           # one GPU, 1.07B parameters
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from k3core.optim.host_arena import HostArena
from k3core.optim.streamed_adam import StreamedAdamW, _flat

# ---- the baseline ------------------------------------------------------------------------------


class FullBufferOffloadAdamW(StreamedAdamW):
    """Baseline: a parameter-sized fp32 host gradient buffer, no overlap (see the module docstring).

    Same host state as StreamedAdamW (8 B/param) plus the buffer (4 B/param) = 12 B/param.
    """

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self._grad_buffer = HostArena(self._numel, torch.float32, self._pin)
        self._buffer_offset, offset = {}, 0
        for p in self._params:
            self._buffer_offset[p] = offset
            offset += _flat(p).numel()

    def _stream(self, chunks, grad_scale) -> None:
        cuda = self.device.type == "cuda"
        buf = self._grad_buffer.data
        if not self._scratch:
            self._scratch = {k: torch.empty(self._tile, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
        # 1. every gradient down into the fp32 host buffer (non_blocking: the cast runs on the device)
        params = [s.param for c in chunks for s in c.segments if s.start == 0]
        for p in params:
            off = self._buffer_offset[p]
            buf[off : off + _flat(p).numel()].copy_(_flat(p.grad), non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        # 2. the host update, chunk by chunk, straight out of the buffer; bf16 weights are written
        #    over the gradients just consumed (same bytes, first half), to be copied up in step 3
        staged = []
        for chunk in chunks:
            for _, _, segs in self._tiles(chunk):  # the same cache-sized tiles as StreamedAdamW
                gs = [buf[self._buffer_offset[s.param] + s.start : self._buffer_offset[s.param] + s.end] for s in segs]
                self._adamw_segments(chunk.group, segs, gs, grad_scale)
                for s, g in zip(segs, gs):
                    w = g.view(s.param.dtype)[: s.end - s.start] if s.param.dtype.itemsize < 4 else g
                    w.copy_(s.state["master"].view(-1)[s.start : s.end])
                    staged.append((s, w))
        # 3. every weight up
        for s, w in staged:
            _flat(s.param)[s.start : s.end].copy_(w, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def host_bytes(self) -> dict[str, int]:
        out = super().host_bytes()
        out["grad_buffer"] = self._grad_buffer.nbytes
        return out

    def pinned_bytes(self) -> int:
        return super().pinned_bytes() + self._grad_buffer.pinned_nbytes


# ---- measurement helpers -----------------------------------------------------------------------


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def make_workload(n_target: int, hidden: int, device: str) -> list[torch.nn.Parameter]:
    """bf16 [H, H] matrices up to n_target elements, 4 fp32 [H] and 8 bf16 [H] vectors; bf16 grads."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    shapes = [((hidden, hidden), torch.bfloat16)] * max(1, n_target // (hidden * hidden))
    shapes += [((hidden,), torch.float32)] * 4 + [((hidden,), torch.bfloat16)] * 8
    for shape, dtype in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.02)
        p.grad = torch.randn(shape, generator=gen, device=device, dtype=dtype) * 1e-3
        params.append(p)
    return params


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _Timers:
    """Wraps an optimizer instance to time its host updates (perf_counter) and, on CUDA, the busy
    time of its copy streams (events around each chunk's copies)."""

    def __init__(self, opt: StreamedAdamW, cuda: bool) -> None:
        self.update_s, self.events = 0.0, []
        update = opt._update_chunk if not isinstance(opt, FullBufferOffloadAdamW) else opt._adamw_segments

        def timed_update(*a, **k):
            t = time.perf_counter()
            update(*a, **k)
            self.update_s += time.perf_counter() - t

        if isinstance(opt, FullBufferOffloadAdamW):
            opt._adamw_segments = timed_update
        else:
            opt._update_chunk = timed_update
        self.opt, self.cuda = opt, cuda

    def wrap_transport(self) -> None:
        io = self.opt._transport
        if not self.cuda or io is None or getattr(io, "_timed", False):
            return
        for name, stream in (("fetch_grads", io.d2h), ("push_weights", io.h2d)):
            orig = getattr(io, name)

            def timed(*a, _orig=orig, _stream=stream, **k):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(_stream)
                _orig(*a, **k)
                end.record(_stream)
                self.events.append((_stream is io.d2h, start, end))

            setattr(io, name, timed)
        io._timed = True

    def copy_seconds(self) -> tuple[float, float]:
        torch.cuda.synchronize()
        d2h = sum(s.elapsed_time(e) for down, s, e in self.events if down) / 1e3
        h2d = sum(s.elapsed_time(e) for down, s, e in self.events if not down) / 1e3
        return d2h, h2d


def child_optimizer(args) -> dict:
    device = args.device
    if device == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")
    cls = FullBufferOffloadAdamW if args.child == "baseline" else StreamedAdamW
    kernel = "torch" if args.child == "streamed-torch-update" else args.host_kernel
    kw = dict(lr=1e-4, weight_decay=0.1, max_grad_norm=1.0, chunk_numel=args.chunk_numel, tile_numel=args.tile_numel,
              host_kernel=kernel)
    # Warm-up on a tiny copy of the workload: the kernels' code pages of libtorch are file-backed
    # RSS faulted in on first use (tens of MB); they are not optimizer state, so not in the delta.
    tiny = make_workload(1, 64, device)
    warm = cls(tiny, **kw)
    warm.step()
    warm.step()
    del warm, tiny
    params = make_workload(args.params, args.hidden, device)
    n = sum(p.numel() for p in params)
    _sync(device)
    rss0 = _proc_status("VmRSS")
    peak_ok = _reset_peak_rss()
    t = time.perf_counter()
    opt = cls(params, **kw)
    init_s = time.perf_counter() - t
    timers = _Timers(opt, device == "cuda")
    opt.step()  # warm-up: allocates the chunk buffers and pins them
    _sync(device)
    timers.wrap_transport()
    timers.update_s, timers.events = 0.0, []
    times = []
    for _ in range(args.steps):
        _sync(device)
        t = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t)
    peak = _proc_status("VmHWM") if peak_ok else None
    hb = opt.host_bytes()
    fixed = hb["buffers"] + hb["steps"]
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    d2h_bytes = 4 * n if args.child == "baseline" else grad_bytes
    out = {
        "variant": args.child, "params": n, "init_s": init_s, "step_s": statistics.median(times),
        "step_s_all": times, "update_s": timers.update_s / args.steps,
        "rss_delta": None if peak is None else peak - rss0, "host_bytes": hb, "fixed_bytes": fixed,
        "pinned_bytes": opt.pinned_bytes(), "d2h_bytes": d2h_bytes, "h2d_bytes": weight_bytes,
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    out["host_kernel"] = opt.host_kernel
    if device == "cuda" and args.child.startswith("streamed"):
        d2h_s, h2d_s = timers.copy_seconds()
        out["copy_busy_s"] = [d2h_s / args.steps, h2d_s / args.steps]
    return out


def child_pinned_bandwidth(args) -> dict:
    """Pinned host <-> device copy of one 1 GiB buffer, both directions, best of 5."""
    nbytes = 1 << 30
    host = HostArena(nbytes, torch.uint8, pin=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    res = {}
    for name, fn in (("h2d", lambda: dev.copy_(host.data, non_blocking=True)), ("d2h", lambda: host.data.copy_(dev, non_blocking=True))):
        best = float("inf")
        for _ in range(6):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        res[name + "_GBps"] = nbytes / best / 1e9
    return res


def child_torch_adamw(args) -> dict:
    """torch.optim.AdamW on fp32 host tensors (fp32 grads and moments: 16 B/param), params/s."""
    params = [p.detach().float().requires_grad_() for p in make_workload(args.params, args.hidden, "cpu")]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kind = args.child.split("-")[-1]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **{kind: True})
    opt.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    n = sum(p.numel() for p in params)
    return {"variant": args.child, "params": n, "step_s": statistics.median(times), "threads": torch.get_num_threads()}


def child_host_update(args) -> dict:
    """StreamedAdamW's host update alone (params and grads on the CPU), bf16 or fp32 moments."""
    params = make_workload(args.params, args.hidden, "cpu")
    moment = torch.float32 if args.child.endswith("fp32") else torch.bfloat16
    kernel = "c" if args.child.endswith("-c") else "torch"
    opt = StreamedAdamW(params, lr=1e-4, weight_decay=0.1, chunk_numel=args.chunk_numel, tile_numel=args.tile_numel,
                        moment_dtype=moment, host_kernel=kernel)  # fmt: skip
    opt.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    n = sum(p.numel() for p in params)
    return {"variant": args.child, "params": n, "step_s": statistics.median(times), "threads": torch.get_num_threads(),
            "tile_numel": opt._tile}  # fmt: skip


def child_kernel_alone(args) -> dict:
    """The C kernel's pass alone over flat host arrays (no gradient staging, no weight stage copy),
    noise read from the real table in runs cut where it wraps: what the bandwidth bound compares to."""
    from k3core.optim import host_kernel
    from k3core.optim.stochastic_rounding import NOISE_TABLE_NUMEL, make_noise_table

    n = args.params
    master, g = torch.randn(n), torch.randn(n).bfloat16()
    m, v, w = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    noise, updater = make_noise_table(0), host_kernel.HostUpdater()
    times = []
    for step in range(1, args.steps + 2):
        coef = host_kernel.coefficients(1e-4, 0.9, 0.999, 1e-8, 0.1, step, None)
        runs = [(master[a:b], m[a:b], v[a:b], g[a:b], w[a:b], coef, noise, 0, 0)
                for a in range(0, n, NOISE_TABLE_NUMEL) for b in [min(a + NOISE_TABLE_NUMEL, n)]]
        t = time.perf_counter()
        updater.run(runs)
        times.append(time.perf_counter() - t)
    return {"variant": args.child, "params": n, "step_s": statistics.median(times[1:]), "threads": updater.threads}


def child_host_bandwidth(args) -> dict:
    """Host memory bandwidth: a 1 GiB fp32 copy with torch's threads, bytes read plus written, best of 5."""
    a = torch.ones(1 << 28)
    b = torch.empty_like(a)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    return {"variant": args.child, "GBps": 2 * a.numel() * 4 / best / 1e9, "threads": torch.get_num_threads()}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


CHILDREN = {
    "streamed": child_optimizer,
    "streamed-torch-update": child_optimizer,
    "host-update-bf16-c": child_host_update,
    "host-kernel-alone": child_kernel_alone,
    "host-bandwidth": child_host_bandwidth,
    "baseline": child_optimizer,
    "bandwidth": child_pinned_bandwidth,
    "torch-foreach": child_torch_adamw,
    "torch-fused": child_torch_adamw,
    "host-update-bf16": child_host_update,
    "host-update-fp32": child_host_update,
}


def run_child(name: str, args, device: str | None = None, params: int | None = None, tile: int | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--device", device or args.device,
           "--params", str(params or args.params), "--hidden", str(args.hidden), "--steps", str(args.steps),
           "--chunk-numel", str(args.chunk_numel), "--tile-numel", str(tile or args.tile_numel),
           "--host-kernel", args.host_kernel]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child {name} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- report ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--params", type=int, default=0, help="target parameter count (default: cpu 64M, cuda 1.07B)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--chunk-numel", type=int, default=1 << 22)
    ap.add_argument("--tile-numel", type=int, default=1 << 20)
    ap.add_argument("--throughput-params", type=int, default=0,
                    help="parameters for the host throughput table (default: cpu --params, cuda 256M)")
    ap.add_argument("--tiles", default="65536,262144,1048576,4194304", help="tile sizes swept for the host update")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--host-kernel", choices=["auto", "c", "torch"], default="auto",
                    help="StreamedAdamW's host path in the step-time rows (the streamed-torch-update row always uses torch)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in every child (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="8M parameters, 2 steps")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return
    if args.quick:
        args.params, args.steps, args.hidden, args.tiles = args.params or (8 << 20), 2, 2048, "65536,262144"
    args.params = args.params or ((64 << 24) if args.device == "cuda" else (64 << 20))
    tp_params = args.throughput_params or ((256 << 20) if args.device == "cuda" else args.params)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")

    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU only"
    print(f"# StreamedAdamW benchmark: device={args.device} ({where}), target params={args.params:,}, "
          f"chunk_numel={args.chunk_numel:,}, steps={args.steps}, host threads={args.threads or torch.get_num_threads()}")  # fmt: skip
    bw = run_child("bandwidth", args) if args.device == "cuda" else None
    res = {name: run_child(name, args) for name in ("baseline", "streamed", "streamed-torch-update")}
    n = res["streamed"]["params"]

    print("\n## Host memory (fresh process each; RSS peak minus RSS before the optimizer existed)")
    print("| variant | params | RSS peak delta B/param | (delta - fixed buffers) B/param | pinned B/param | state B/param | fixed buffers MiB |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        d = r["rss_delta"]
        state = r["host_bytes"]["state"] + r["host_bytes"].get("grad_buffer", 0)
        rss = "n/a (no /proc/self/clear_refs)" if d is None else f"{d / n:.2f} | {(d - r['fixed_bytes']) / n:.2f}"
        print(f"| {name} | {r['params']:,} | {rss} | {r['pinned_bytes'] / n:.2f} "
              f"| {state / n:.2f} | {r['fixed_bytes'] / 2**20:.1f} |")  # fmt: skip
    if res["streamed"]["rss_delta"] and res["baseline"]["rss_delta"]:
        print(f"streamed / baseline host RSS delta: {res['streamed']['rss_delta'] / res['baseline']['rss_delta']:.3f}")
    if res["baseline"]["pinned_bytes"]:
        print(f"streamed / baseline pinned bytes: {res['streamed']['pinned_bytes'] / res['baseline']['pinned_bytes']:.3f}")

    print("\n## Step time (median of the timed steps, after one warm-up step)")
    print("| variant | step s | host update s | params/s (step) | D2H GB | H2D GB | effective PCIe GB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        gb = (r["d2h_bytes"] + r["h2d_bytes"]) / 1e9
        print(f"| {name} | {r['step_s']:.3f} | {r['update_s']:.3f} | {r['params'] / r['step_s'] / 1e6:.1f}M "
              f"| {r['d2h_bytes'] / 1e9:.2f} | {r['h2d_bytes'] / 1e9:.2f} | {gb / r['step_s']:.1f} |")  # fmt: skip
    print(f"streamed / baseline step time: {res['streamed']['step_s'] / res['baseline']['step_s']:.3f} (target <= 1.1)")
    if bw is not None:
        s = res["streamed"]
        d2h_s, h2d_s = s["copy_busy_s"]
        print(f"\npinned copy bandwidth, 1 GiB, same run: H2D {bw['h2d_GBps']:.1f} GB/s, D2H {bw['d2h_GBps']:.1f} GB/s")
        print(f"streamed chunk copies while busy: D2H {s['d2h_bytes'] / d2h_s / 1e9:.1f} GB/s "
              f"({s['d2h_bytes'] / d2h_s / 1e9 / bw['d2h_GBps']:.0%} of pinned), "
              f"H2D {s['h2d_bytes'] / h2d_s / 1e9:.1f} GB/s ({s['h2d_bytes'] / h2d_s / 1e9 / bw['h2d_GBps']:.0%} of pinned); "
              f"copy busy {d2h_s + h2d_s:.3f} s of a {s['step_s']:.3f} s step, host update {s['update_s']:.3f} s")  # fmt: skip

    print(f"\n## Host update throughput on this CPU ({tp_params:,} target params; params and grads in host memory)")
    print("| optimizer | host B/param (state+grad) | tile | step s | params/s | vs torch fused |")
    print("|---|---|---|---|---|---|")
    tp = {name: run_child(name, args, device="cpu", params=tp_params) for name in ("torch-foreach", "torch-fused")}
    tp["host-update-fp32"] = run_child("host-update-fp32", args, device="cpu", params=tp_params)
    for tile in (int(t) for t in args.tiles.split(",")):
        tp[f"host-update-bf16 tile {tile}"] = run_child("host-update-bf16", args, device="cpu", params=tp_params, tile=tile)
    tp["host-update-bf16 C kernel"] = run_child("host-update-bf16-c", args, device="cpu", params=tp_params)
    tp["C kernel pass alone"] = run_child("host-kernel-alone", args, device="cpu", params=tp_params)
    fused = tp["torch-fused"]["params"] / tp["torch-fused"]["step_s"]
    for name, r in tp.items():
        rate = r["params"] / r["step_s"]
        desc = "16 (fp32 p,g,m,v)" if name.startswith("torch") else ("12 + 2 bf16 grad" if "fp32" in name else "8 + 2 bf16 grad")
        print(f"| {name} | {desc} | {r.get('tile_numel', '-')} | {r['step_s']:.3f} | {rate / 1e6:.1f}M | {rate / fused:.2f} |")
    hbw = run_child("host-bandwidth", args, device="cpu")
    bound = hbw["GBps"] * 1e9 / 20
    alone = tp["C kernel pass alone"]["params"] / tp["C kernel pass alone"]["step_s"]
    print(f"(threads per child: {tp['torch-fused']['threads']}; host-update rows are full StreamedAdamW steps on CPU "
          f"tensors: grad staging, the update, weight write-back; on CUDA the staging copies are DMA)")  # fmt: skip
    print(f"host memory bandwidth (1 GiB copy, read + write): {hbw['GBps']:.1f} GB/s -> bound at 20 B/param "
          f"{bound / 1e6:.0f}M params/s; C kernel pass alone {alone / 1e6:.0f}M params/s = {alone / bound:.2f} of the bound, "
          f"{alone / fused:.2f}x torch fused fp32")  # fmt: skip


if __name__ == "__main__":
    main()
