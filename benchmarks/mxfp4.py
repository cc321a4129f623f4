"""MXFP4 codec throughput: k3core.ops.mxfp4 vs the obvious torch code vs compressed-tensors.

Claim: quantize/dequantize run at memory speed on GPU (target >= 60% of the copy bandwidth
measured in the same run) and beat the straightforward unchunked torch implementation on CPU
while holding only a few MB of temporaries.

    python benchmarks/mxfp4.py                 # CPU, 4096 x 4096 bf16, 1 thread (--threads N)
    python benchmarks/mxfp4.py --device cuda   # GPU, 8192 x 8192 bf16, plus a 1 GiB copy
    python benchmarks/mxfp4.py --quick         # smoke run

GB/s counts the bf16 tensor (2 bytes per element) per second, for quantize and dequantize alike.
"traffic" counts every byte read and written (quantize: 2 + 0.5 + 1/32 bytes per element;
dequantize the reverse), which is what compares with a copy (1 byte read + 1 written per byte).
Each implementation's output is checked against ours before it is timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from k3core.ops import mxfp4  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# --- the obvious torch implementation (baseline): fp32, whole tensor at once -----------------


def naive_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = w.float().reshape(-1, 32)
    amax = x.abs().amax(dim=1, keepdim=True)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    power = exponent - 1 + (mantissa >= 0.875).int()  # round the max up when 2 * mantissa >= 1.75
    byte = torch.where(amax == 0, 0, (power - 2 + 127).clamp(0, 254))
    y = x / torch.exp2((byte - 127).float())
    mag = y.abs()
    code = (
        (mag > 0.25).int() + (mag >= 0.75).int() + (mag > 1.25).int() + (mag >= 1.75).int()
        + (mag > 2.5).int() + (mag >= 3.5).int() + (mag > 5.0).int()
    )
    code = (code + 8 * (y < 0).int()).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    lead = w.shape[:-1]
    return packed.reshape(*lead, -1), byte.to(torch.uint8).reshape(*lead, -1)


def naive_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
    values = E2M1.to(packed.device)[codes].reshape(-1, 32)
    values = values * torch.exp2(scale.reshape(-1, 1).float() - 127)
    return values.to(dtype).reshape(*packed.shape[:-1], -1)


# --- compressed-tensors (the release's library) -------------------------------------------------


def library_codec():
    """(compress, decompress) through compressed-tensors' own code, or None when not installed."""
    try:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    except ImportError:
        return None
    args = QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, dynamic=False,
        scale_dtype=torch.uint8,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")

    def compress(w):
        scale, _ = compute_dynamic_scales_and_zp(w, args, module=None)
        out = compressor.compress({"weight": w, "weight_scale": scale}, scheme)
        return out["weight_packed"], out["weight_scale"]

    def decompress(packed, scale):
        return compressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"]

    return compress, decompress


# --- timing --------------------------------------------------------------------------------------


def time_ms(fn, device: str, repeats: int) -> tuple[float, float]:
    """(median wall ms, median process CPU ms; the latter is NaN on CUDA)."""
    fn()  # warm-up (Triton compile, allocator, tables)
    wall, cpu = [], []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            wall.append(start.elapsed_time(end))
            cpu.append(float("nan"))
        else:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def copy_bandwidth(device: str, repeats: int) -> float:
    """GB/s of traffic (read + write) of y.copy_(x) for a 1 GiB tensor."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms, _ = time_ms(lambda: y.copy_(x), device, repeats)
    return 2 * x.numel() / ms / 1e6


def peak_rss_mb(op: str, rows: int, cols: int) -> float:
    """Peak resident memory added by one call of `op` (CPU), in MB: a fresh process resets its
    high-water mark (/proc/self/clear_refs) after building the inputs, then reads VmHWM - VmRSS."""
    code = f"""
import sys, torch
sys.path.insert(0, {os.path.join(os.path.dirname(__file__), '..')!r})
sys.path.insert(0, {os.path.dirname(__file__)!r})
from k3core.ops import mxfp4
import mxfp4 as bench
def status(key):
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key + ':'))
w = torch.randn({rows}, {cols}, dtype=torch.bfloat16)
p, s = mxfp4.quantize(w)
ops = {{"quantize": lambda: mxfp4.quantize(w), "dequantize": lambda: mxfp4.dequantize(p, s),
       "naive_quantize": lambda: bench.naive_quantize(w),
       "naive_dequantize": lambda: bench.naive_dequantize(p, s)}}
open('/proc/self/clear_refs', 'w').write('5')
before = status('VmRSS')
ops["{op}"]()
print((status('VmHWM') - before) / 1024)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(res.stdout.strip().splitlines()[-1])


def sweep_tiles(w, packed, scale, repeats: int, traffic: float, copy_gbs: float) -> None:
    """Time the Triton kernels (no finite check) at other (blocks per program, warps) settings."""
    from k3core.ops.mxfp4 import codec_triton as kt

    saved = (kt.BF16_QUANT_GROUPS, kt.BF16_QUANT_WARPS, kt.DEQUANT_GROUPS, kt.DEQUANT_WARPS)
    kernels = ("words", "bf16x2")
    print(f"\nTriton tile sweep, bf16 quantize ({', '.join(kernels)} kernels) and dequantize (traffic GB/s, % of copy):")
    try:
        for groups in (64, 128, 256):
            for warps in (2, 4, 8):
                kt.BF16_QUANT_GROUPS = kt.DEQUANT_GROUPS = groups
                kt.BF16_QUANT_WARPS = kt.DEQUANT_WARPS = warps
                cells = []
                for kernel in kernels:
                    out_q = kt.quantize_triton(w, check_finite=False, kernel=kernel)
                    assert torch.equal(out_q[0], packed) and torch.equal(out_q[1], scale), kernel
                    q_ms, _ = time_ms(lambda: kt.quantize_triton(w, check_finite=False, kernel=kernel), "cuda", repeats)
                    q = traffic / q_ms / 1e6
                    cells.append(f"{kernel} {q:6.0f} ({100 * q / copy_gbs:3.0f}%)")
                d_ms, _ = time_ms(lambda: kt.dequantize_triton(packed, scale), "cuda", repeats)
                d = traffic / d_ms / 1e6
                print(f"  groups {groups:3d} warps {warps}: quantize {'  '.join(cells)}"
                      f"  dequantize {d:6.0f} ({100 * d / copy_gbs:3.0f}%)")
    finally:
        kt.BF16_QUANT_GROUPS, kt.BF16_QUANT_WARPS, kt.DEQUANT_GROUPS, kt.DEQUANT_WARPS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--cols", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--library-rows", type=int, help="rows given to compressed-tensors on CPU (it is slow)")
    parser.add_argument("--sweep", action="store_true", help="CUDA: also time other Triton tile sizes")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch.set_num_threads on CPU (default 1: on a busy 2-core host OpenMP threads spin)",
    )
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    device = args.device
    big = 8192 if device == "cuda" else 4096
    rows = args.rows or (1024 if args.quick else big)
    cols = args.cols or (1024 if args.quick else big)
    repeats = args.repeats or (3 if args.quick else (20 if device == "cuda" else 5))
    n = rows * cols

    torch.manual_seed(0)
    w = (torch.randn(rows, cols, device=device) * 0.02).to(torch.bfloat16)
    packed, scale = mxfp4.quantize(w)
    traffic_q = n * (2 + 0.5 + 1 / 32)
    traffic_d = traffic_q

    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} "
          f"({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"triton path: {mxfp4.triton_available() and device == 'cuda'}")
    print(f"tensor: {rows} x {cols} bf16 ({2 * n / 2**20:.0f} MiB), median of {repeats}")
    copy_gbs = None
    if device == "cuda":
        copy_gbs = copy_bandwidth(device, repeats)
        print(f"copy bandwidth (1 GiB y.copy_(x)): {copy_gbs:.0f} GB/s of traffic")

    rows_out = []

    def bench(label: str, fn, check, traffic: float, elems: int = n):
        out = fn()
        try:
            check(out)
        except AssertionError as err:  # still time it, but say so in the table
            print(f"WARNING: {label}: output differs from k3core's ({err})")
            label += " [DIFFERS]"
        ms, cpu_ms = time_ms(fn, device, repeats)
        rows_out.append((label, ms, cpu_ms, 2 * elems / ms / 1e6, traffic * elems / n / ms / 1e6))

    def same_q(out):
        assert torch.equal(out[0], packed) and torch.equal(out[1], scale), "quantize mismatch"

    reference = mxfp4.dequantize_torch(packed, scale)

    def same_d(out):
        assert torch.equal(out.view(torch.int16), reference.view(torch.int16)), "dequantize mismatch"

    bench("quantize: k3core (dispatch)", lambda: mxfp4.quantize(w), same_q, traffic_q)
    if device == "cuda" and mxfp4.triton_available():
        import triton  # noqa: PLC0415

        from k3core.ops.mxfp4 import codec_triton as kt
        from k3core.ops.mxfp4.codec_triton import quantize_triton

        # The dispatch above includes the finite check's host sync; this is the kernel alone.
        bench("quantize: k3core Triton, no finite check", lambda: quantize_triton(w, check_finite=False),
              same_q, traffic_q)
        # baseline: the first (any-dtype, reshape/split) kernel, which the bf16 kernel replaced
        bench("quantize: generic Triton kernel, no finite check",
              lambda: quantize_triton(w, check_finite=False, kernel="generic"), same_q, traffic_q)
        # the previous default for bf16: integer codes on the words layout (codec_triton.py docstring)
        bench("quantize: words Triton kernel, no finite check",
              lambda: quantize_triton(w, check_finite=False, kernel="words"), same_q, traffic_q)
        # ceiling of the bf16 kernels' memory pattern: same loads and stores, no codec work
        from mxfp4_sass import _load_store_floor  # noqa: PLC0415 (benchmarks/ is sys.path[0])

        out_words = torch.empty(n // 8, dtype=torch.int32, device=device)
        out_scale = torch.empty(n // 32, dtype=torch.uint8, device=device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        bench("quantize floor: load + store only, no codec (not a quantizer)",
              lambda: _load_store_floor[(triton.cdiv(n // 32, kt.BF16_QUANT_GROUPS),)](
                  w.view(torch.int32), out_words, out_scale, flag, n // 32, ROUND_BIAS=0, NEG_ZERO_FIELD=0,
                  GROUPS=kt.BF16_QUANT_GROUPS, num_warps=kt.BF16_QUANT_WARPS),
              lambda out: None, traffic_q)
    if device == "cuda":
        bench("quantize: k3core torch path", lambda: mxfp4.quantize_torch(w), same_q, traffic_q)
    bench("quantize: naive torch", lambda: naive_quantize(w), same_q, traffic_q)
    bench("dequantize: k3core (dispatch)", lambda: mxfp4.dequantize(packed, scale), same_d, traffic_d)
    if device == "cuda":
        bench("dequantize: k3core torch path", lambda: mxfp4.dequantize_torch(packed, scale), same_d, traffic_d)
    bench("dequantize: naive torch", lambda: naive_dequantize(packed, scale), same_d, traffic_d)

    if args.sweep and device == "cuda" and mxfp4.triton_available():
        sweep_tiles(w, packed, scale, repeats, traffic_q, copy_gbs)

    codec = library_codec()
    if codec is not None:
        compress, decompress = codec
        lib_rows = args.library_rows or (rows if device == "cuda" else max(1, min(rows, 65536 // cols * 4)))
        wl, pl, sl = w[:lib_rows], packed[:lib_rows], scale[:lib_rows]
        elems = lib_rows * cols

        def same_lq(out):
            assert torch.equal(out[0], pl) and torch.equal(out[1], sl), "compressed-tensors mismatch"

        def same_ld(out):
            assert torch.equal(out.view(torch.int16), reference[:lib_rows].view(torch.int16))

        suffix = "" if lib_rows == rows else f" ({lib_rows} rows)"
        bench("quantize: compressed-tensors" + suffix, lambda: compress(wl), same_lq, traffic_q, elems)
        bench("dequantize: compressed-tensors" + suffix, lambda: decompress(pl, sl), same_ld, traffic_d, elems)
    else:
        print("compressed-tensors not installed: its rows are skipped")

    naive = {r[0].split(":")[0]: r for r in rows_out if "naive" in r[0]}
    cpu_col = device == "cpu"
    header = f"| {'implementation':42} | {'wall ms':>9} |"
    if cpu_col:
        header += f" {'CPU ms':>9} |"
    header += f" {'GB/s bf16':>9} | {'traffic GB/s':>12} | {'vs naive':>8} |"
    if cpu_col:
        header += " CPU time vs naive |"
    if copy_gbs:
        header += " % of copy BW |"
    print()
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for label, ms, cpu_ms, gbs, traffic in rows_out:
        base = naive[label.split(":")[0].split()[0]]  # "quantize floor" -> the quantize baseline
        line = f"| {label:42} | {ms:9.2f} |"
        if cpu_col:
            line += f" {cpu_ms:9.2f} |"
        line += f" {gbs:9.3f} | {traffic:12.3f} | {gbs / base[3]:7.2f}x |"
        if cpu_col:
            per_elem = cpu_ms / (gbs * ms)  # CPU ms per byte, so subsets compare fairly
            base_per_elem = base[2] / (base[3] * base[1])
            line += f" {base_per_elem / per_elem:16.2f}x |"
        if copy_gbs:
            line += f" {100 * traffic / copy_gbs:11.0f}% |"
        print(line)

    if device == "cpu" and not args.quick:
        print()
        print("peak extra resident memory of one call (fresh process; includes the outputs):")
        for op in ("quantize", "naive_quantize", "dequantize", "naive_dequantize"):
            print(f"  {op:18} {peak_rss_mb(op, rows, cols):8.1f} MB")


if __name__ == "__main__":
    main()
