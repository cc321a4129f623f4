"""Claim: the fused W4A8 expert kernel reads the bytes of the experts a call uses near the HBM copy
bandwidth, at decode batch sizes, on the medium preset's and the full model's expert shapes.

Same run, same inputs (rows routed to experts at random, seeded; FP8 per-token activations):
  - the kernel (``grouped_mm_triton``, its default tile shape ``kernel_config``);
  - ``--baseline FILE``: another version of ``grouped_mm_triton.py`` (an earlier commit's, e.g.
    ``git show <rev>:k3core/ops/w4a8/grouped_mm_triton.py > /tmp/old.py``) on the same inputs;
  - bf16 experts: ``torch._grouped_mm`` (cuBLAS/CUTLASS grouped GEMM, what the engine runs for bf16
    experts) over the same experts decoded to bf16, which reads 3.8x the weight bytes;
  - ``--sweep``: every tile shape of a small grid, and the best one per row;
  - ``--variants``: the default tile with each decode variant (``KernelConfig.hw_cvt``, ``scale_once``);
  - the per-token FP8 quantisation before each call: torch's ``quantize_fp8`` (about eleven
    kernels) against the one-kernel ``fp8_triton`` quantiser (the same bytes).

Every variant is timed inside a CUDA graph that replays calls over enough copies of the layer's
expert stack that the weights a call reads exceed 4x the L2 cache: each call reads its weights from
HBM, as a decode step does (46 different expert stacks per step on medium). The bytes a call must
move: the packed weights and scales of the experts it uses, plus the FP8 activations and their
scales, plus the bf16 output; "% bw" is those bytes per second against a device-to-device copy
measured in the same run. Shapes:
  - medium, up (gate and up) and down: 64 experts, top-8, latent 768, expert width 384;
  - full, up and down: 112 experts (one GPU of 8-way expert parallelism over the release's 896),
    latent 3584, width 3072; each token picks 16 distinct of 896 experts, and this GPU gets the rows
    of the 112 it holds (2 rows per token on average).

    python benchmarks/w4a8_grouped.py --device cuda [--batches 1,64,256] [--baseline /tmp/old.py] [--sweep]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math

import torch

from k3core.ops import mxfp4
from k3core.ops.w4a8 import quantize_fp8
from k3core.ops.w4a8 import grouped_mm_triton as kernel
from k3core.ops.w4a8.fp8_triton import quantize_fp8_token_triton

SHAPES = {  # name: (experts on this GPU, experts in the model, top-k, M, K)
    "medium-up": (64, 64, 8, 768, 768),
    "medium-down": (64, 64, 8, 768, 384),
    "full-up": (112, 896, 16, 6144, 3584),
    "full-down": (112, 896, 16, 3584, 3072),
}
SWEEP = [kernel.KernelConfig(bm, bk, w, st) for bm, bk, w, st in
         itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3,))]


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of repeats."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * nbytes / sorted(times)[repeats // 2]


def route(batch: int, local: int, total: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """Rows per local expert: each of ``batch`` tokens picks ``topk`` distinct experts of ``total``."""
    picks = torch.rand(batch, total, generator=g).argsort(1)[:, :topk].flatten()
    return torch.bincount(picks[picks < local], minlength=local)


def time_graph(fn, calls: int, replays: int = 5) -> float:
    """Seconds per call of ``fn(i)`` for i in range(calls), captured once as a CUDA graph."""
    fn(0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm the allocator's pool for the capture
            fn(i)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return sorted(times)[replays // 2]


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("w4a8_baseline_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.w4a8_grouped_mm_triton


VARIANTS = {"neither": dict(hw_cvt=False, scale_once=False), "hw_cvt": dict(hw_cvt=True, scale_once=False),
            "scale_once": dict(hw_cvt=False, scale_once=True), "both": dict(hw_cvt=True, scale_once=True)}


def bench_row(shape: str, batch: int, baseline, sweep: bool, l2: int, g: torch.Generator, variants: bool = False) -> dict:
    local, total, topk, M, K = SHAPES[shape]
    counts = route(batch, local, total, topk, g).cuda()
    n = int(counts.sum())
    used = int((counts > 0).sum())
    w_bytes = used * M * (K // 2 + K // 32)
    io_bytes = n * (K + 4) + n * M * 2
    copies = max(1, min(64, math.ceil(4 * l2 / (w_bytes + io_bytes))))
    gen = torch.Generator(device="cuda").manual_seed(batch)
    w = torch.randn(local, M, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    packed, scale = mxfp4.quantize(w)
    del w
    stacks = [(packed.clone(), scale.clone()) for _ in range(copies)]
    x = torch.randn(n, K, device="cuda", generator=gen).bfloat16()
    q, s = quantize_fp8(x, "token")
    row = {"shape": shape, "batch": batch, "rows": n, "used": used, "bytes": w_bytes + io_bytes, "copies": copies}

    def run(fn, cfg=None):
        return time_graph(lambda i: fn(q, s, counts, *stacks[i % copies], torch.bfloat16, **({"config": cfg} if cfg else {})),
                          2 * copies)

    ref = kernel.w4a8_grouped_mm_triton(q, s, counts, packed, scale, torch.float32)
    torch_ref = kernel_torch_path(x, counts, packed, scale)
    row["max_err"] = float((ref - torch_ref).abs().max()) if n else 0.0
    row["new"] = run(kernel.w4a8_grouped_mm_triton)
    row["quant_torch"] = time_graph(lambda i: quantize_fp8(x, "token"), 8)
    row["quant_fused"] = time_graph(lambda i: quantize_fp8_token_triton(x), 8)
    row["config"] = kernel.kernel_config(n, local, M, K, q.device)
    if baseline is not None:
        row["baseline"] = run(baseline)
    if variants:
        row["variants"] = {}
        for name, kw in VARIANTS.items():
            cfg = row["config"]._replace(**kw)
            err = float((kernel.w4a8_grouped_mm_triton(q, s, counts, packed, scale, torch.float32, config=cfg) - ref).abs().max()) if n else 0.0
            row["variants"][name] = (run(kernel.w4a8_grouped_mm_triton, cfg), err)
    wb = mxfp4.dequantize(packed, scale, torch.bfloat16)
    bf_bytes = used * M * K * 2 + n * K * 2 + n * M * 2
    bcopies = max(1, min(copies, math.ceil(4 * l2 / bf_bytes), (16 << 30) // wb.numel() // 2))
    bstacks = [wb.clone() for _ in range(bcopies)]
    del wb
    offs = torch.cumsum(counts, 0).to(torch.int32)
    row["bf16"] = time_graph(lambda i: torch._grouped_mm(x, bstacks[i % bcopies].transpose(-2, -1), offs=offs), 2 * bcopies)
    bstacks.clear()
    if sweep:
        best = None
        for cfg in SWEEP:
            if cfg.bk > K:
                continue
            try:
                t = run(kernel.w4a8_grouped_mm_triton, cfg)
            except Exception as e:  # a shape triton cannot compile (shared memory): not a candidate
                print(f"    {shape} batch {batch} {cfg}: {type(e).__name__}")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        row["best"] = best
    stacks.clear()
    torch.cuda.empty_cache()
    return row


def kernel_torch_path(x, counts, packed, scale):
    from k3core.ops.w4a8 import w4a8_grouped_mm

    return w4a8_grouped_mm(x, counts, packed, scale, "token", out_dtype=torch.float32, use_triton=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda"])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--baseline", default=None, help="a grouped_mm_triton.py to time on the same inputs")
    ap.add_argument("--sweep", action="store_true", help="time every tile shape of a grid (compiles each)")
    ap.add_argument("--variants", action="store_true", help="time the decode variants on the default tile")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    bw = copy_bandwidth()
    baseline = load_baseline(a.baseline) if a.baseline else None
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, copy bandwidth {bw / 1e9:.0f} GB/s (measured), "
          f"torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    rows = [bench_row(sh, b, baseline, a.sweep, l2, g, a.variants) for sh in a.shapes.split(",")
            for b in map(int, a.batches.split(","))]
    print("\nper call, inside a CUDA graph, weights read from HBM; bytes = used experts' packed weights + scales + io")
    head = f"{'shape':>12} {'batch':>5} {'rows':>5} {'used':>4} {'MB':>7} {'kernel us':>9} {'% bw':>5}"
    if baseline:
        head += f" {'baseline us':>11} {'speedup':>7}"
    head += f" {'bf16 us':>8} {'vs bf16':>7} {'quant us torch/fused':>20} {'max|err|':>9}  config"
    print(head)
    for r in rows:
        line = (f"{r['shape']:>12} {r['batch']:>5} {r['rows']:>5} {r['used']:>4} {r['bytes'] / 1e6:>7.2f} "
                f"{r['new'] * 1e6:>9.1f} {100 * r['bytes'] / r['new'] / bw:>5.1f}")
        if baseline:
            line += f" {r['baseline'] * 1e6:>11.1f} {r['baseline'] / r['new']:>6.1f}x"
        cfg = r["config"]
        line += (f" {r['bf16'] * 1e6:>8.1f} {r['bf16'] / r['new']:>6.2f}x "
                 f"{r['quant_torch'] * 1e6:>10.1f} /{r['quant_fused'] * 1e6:>8.1f} {r['max_err']:>9.2g}  "
                 f"bm={cfg.bm} bk={cfg.bk} w={cfg.num_warps} st={cfg.num_stages}")
        print(line)
    if a.variants:
        print("\ndecode variants on the default tile (us, % bw, speedup against the default; max |diff| to it)")
        for r in rows:
            cells = "  ".join(f"{name} {t * 1e6:7.1f} {100 * r['bytes'] / t / bw:4.1f}% {r['new'] / t:5.2f}x {e:.0e}"
                              for name, (t, e) in r["variants"].items())
            print(f"{r['shape']:>12} {r['batch']:>5}  {cells}")
    if a.sweep:
        print("\nbest tile shape of the sweep per row (us, % bw, against the default)")
        for r in rows:
            if r["best"]:
                t, c = r["best"]
                print(f"{r['shape']:>12} {r['batch']:>5} {t * 1e6:>8.1f} {100 * r['bytes'] / t / bw:>5.1f}% "
                      f"{r['new'] / t:>5.2f}x  bm={c.bm} bk={c.bk} w={c.num_warps} st={c.num_stages}")


if __name__ == "__main__":
    main()
