"""SiTU-GLU: streaming op (`situ_glu`) vs naive autograd vs torch.compile(naive), same run.

Claims measured (baseline: the naive plain-torch expression, `situ_glu_reference`):
  * bytes autograd saves for backward (target: ours = 1/6 of naive for bf16 input),
  * peak memory of one forward+backward above the inputs,
  * time of one forward+backward (target: faster than torch.compile(naive)),
  * on CUDA: ours' effective bandwidth, 16 bytes per output element for fwd+bwd (fwd reads gate and
    up, writes out: 6 B; bwd reads gate, up, grad, writes d_gate, d_up: 10 B; bf16), as a % of
    the HBM copy bandwidth measured in the same run (1 GiB y.copy_(x), read + write counted);
    target >= 80 %.

    python benchmarks/situ.py                  # CPU: R = 16 x 512, H = 1024, bf16
    python benchmarks/situ.py --device cuda    # R = 16 x 8192, H = 3072, bf16
    python benchmarks/situ.py --device cuda --sweep   # also time triton tile configs
    python benchmarks/situ.py --quick          # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3core.ops.memory_probe import peak_bytes, saved_tensors  # noqa: E402
from k3core.ops.situ import situ_glu, situ_glu_reference  # noqa: E402

BYTES_PER_OUTPUT = 16  # bf16 fwd+bwd, see the module docstring


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, iters, warmup=None):
    """(median, best) wall time of fn() in ms (CUDA: events around each call)."""
    warmup = warmup if warmup is not None else (3 if device.type == "cuda" else 1)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def copy_bandwidth_gbs(device, iters):
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device, iters)[0]
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def fwd_bwd(fn, x, grad):
    out = fn(x)
    (dx,) = torch.autograd.grad(out, x, grad)
    return dx


def mib(n):
    return f"{n / 2**20:,.1f}"


def sweep_triton(x, grad, iters):
    """Time the triton kernels alone over a few tile configs (BLOCK_R, BLOCK_H, warps)."""
    from k3core.ops.situ import fused_triton as st

    x2d, g2d = x.detach().view(-1, x.shape[-1]), grad.view(-1, grad.shape[-1])
    R, H = g2d.shape
    print("\ntriton tile sweep (kernel only): fwd 6 B/elem, bwd 10 B/elem; "
          "math: fast = the 16-bit arithmetic (default for bf16), exact = the fp32-grade one (baseline)")
    print(f"{'math':>5} {'elems':>6} {'warps':>5} {'fwd ms':>8} {'fwd GB/s':>9} {'bwd ms':>8} {'bwd GB/s':>9}")
    for fast in (True, False):
        for elems in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                cfg = st.launch_config(H, elems, warps)
                f = time_ms(lambda: st.situ_glu_fwd(x2d, 4.0, 25.0, cfg, fast=fast), x.device, iters)[0]
                b = time_ms(lambda: st.situ_glu_bwd(x2d, g2d, 4.0, 25.0, cfg, fast=fast), x.device, iters)[0]
                print(
                    f"{'fast' if fast else 'exact':>5} {elems:>6} {warps:>5} {f:>8.3f} {6 * R * H / f / 1e6:>9.0f} "
                    f"{b:>8.3f} {10 * R * H / b / 1e6:>9.0f}"
                )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rows", type=int, help="R = tokens x experts (default 16x512 CPU, 16x8192 CUDA)")
    p.add_argument("--hidden", type=int, help="H (default 1024 CPU, 3072 CUDA)")
    p.add_argument("--iters", type=int, help="timed iterations (median reported)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile(naive)")
    p.add_argument("--sweep", action="store_true", help="CUDA: time triton tile configs too")
    p.add_argument("--quick", action="store_true", help="small shapes, few iterations")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU intra-op threads (default 1: on a shared CPU, OpenMP barriers across "
                        "busy cores make multi-thread timings erratic for every variant)")
    args = p.parse_args()

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    R = args.rows or (16 * (8192 if cuda else 512) // (8 if args.quick else 1))
    H = args.hidden or (3072 if cuda else 1024) // (4 if args.quick else 1)
    iters = args.iters or (3 if args.quick else (20 if cuda else 3))
    torch.manual_seed(0)
    x = (torch.randn(R, 2 * H, device=device) * 4).bfloat16().requires_grad_()
    grad = torch.randn(R, H, device=device).bfloat16()
    print(f"SiTU-GLU fwd+bwd, R={R}, H={H}, bf16, device={device}"
          + (f" ({torch.cuda.get_device_name(device)})" if cuda else f" ({torch.get_num_threads()} threads)"))
    print(f"torch {torch.__version__}, {iters} timed iterations (median, and best); speedup on medians")

    variants = {"naive": situ_glu_reference}
    if not args.no_compile:
        variants["compile(naive)"] = torch.compile(situ_glu_reference)
    variants["ours"] = situ_glu
    if cuda:  # the CUDA torch fallback (no triton), for reference
        variants["ours torch-path"] = lambda t: situ_glu(t, backend="torch")

    rows = {}
    for name, fn in variants.items():
        try:
            t0 = time.perf_counter()
            fwd_bwd(fn, x, grad)  # compile / warm caches outside the measurements
            sync(device)
            first_s = time.perf_counter() - t0
        except Exception as exc:  # torch.compile may lack a compiler: report it, keep going
            print(f"{name}: FAILED ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
            continue
        try:
            out, saved = saved_tensors(lambda: fn(x))
            saved_b = saved.bytes
            del out
        except Exception as exc:
            print(f"{name}: saved-tensor hooks failed ({type(exc).__name__}); saved bytes n/a")
            saved_b = None
        _, peak = peak_bytes(lambda: fwd_bwd(fn, x, grad), device)
        ms, best = time_ms(lambda: fwd_bwd(fn, x, grad), device, iters)
        rows[name] = dict(saved=saved_b, peak=peak, ms=ms, best=best, first_s=first_s)

    naive = rows["naive"]
    print(f"\n{'variant':<18} {'saved MiB':>10} {'vs naive':>9} {'peak MiB':>10} {'vs naive':>9} "
          f"{'fwd+bwd ms':>11} {'best ms':>8} {'speedup':>8} {'1st call s':>11}")
    for name, r in rows.items():
        saved = "n/a" if r["saved"] is None else mib(r["saved"])
        saved_ratio = "n/a" if r["saved"] is None else f"{r['saved'] / naive['saved']:.4f}"
        print(f"{name:<18} {saved:>10} {saved_ratio:>9} {mib(r['peak']):>10} "
              f"{r['peak'] / naive['peak']:>9.3f} {r['ms']:>11.2f} {r['best']:>8.2f} {naive['ms'] / r['ms']:>7.2f}x "
              f"{r['first_s']:>11.1f}")
    ours = rows["ours"]
    print(f"\nsaved bytes: ours / naive = {ours['saved'] / naive['saved']:.6f} (target 1/6 = {1 / 6:.6f}); "
          f"input bytes = {mib(x.numel() * x.element_size())} MiB")
    if "compile(naive)" in rows:
        c = rows["compile(naive)"]
        print(f"time: ours {ours['ms']:.2f} ms vs compile(naive) {c['ms']:.2f} ms -> "
              f"{c['ms'] / ours['ms']:.2f}x ({'beats' if ours['ms'] < c['ms'] else 'MISSES'} target)")
    if cuda:
        copy = copy_bandwidth_gbs(device, iters)
        eff = BYTES_PER_OUTPUT * R * H / (ours["ms"] * 1e-3) / 1e9
        print(f"HBM copy bandwidth (1 GiB y.copy_(x), read+write): {copy:,.0f} GB/s")
        print(f"ours effective bandwidth ({BYTES_PER_OUTPUT} B/output, fwd+bwd): {eff:,.0f} GB/s = "
              f"{100 * eff / copy:.1f}% of copy ({'meets' if eff >= 0.8 * copy else 'MISSES'} the 80% target)")
        try:
            from k3core.ops.situ import fused_triton as st
        except ImportError:
            print("triton not importable: 'ours' ran the CUDA torch fallback")
            return
        x2d = x.detach()
        f = time_ms(lambda: st.situ_glu_fwd(x2d, 4.0, 25.0), device, iters)[0]
        b = time_ms(lambda: st.situ_glu_bwd(x2d, grad, 4.0, 25.0), device, iters)[0]
        print(f"triton kernels alone: fwd {f:.3f} ms = {6 * R * H / f / 1e6:,.0f} GB/s "
              f"({100 * 6 * R * H / f / 1e6 / copy:.1f}% of copy), bwd {b:.3f} ms = "
              f"{10 * R * H / b / 1e6:,.0f} GB/s ({100 * 10 * R * H / b / 1e6 / copy:.1f}% of copy)")
        if args.sweep:
            sweep_triton(x, grad, iters)


if __name__ == "__main__":
    main()
