"""KDA operator speed: our chunked torch op vs the per-token loop and vs transformers' fallback.

Claims (targets): on CPU, ``k3core.ops.kda.kda`` (chunked torch path) is >= 10x faster than the
per-token loop (``naive_kda``) and faster than the torch chunk fallback of transformers' Kimi
Linear model (``chunk_kimi_delta_attention`` in ``transformers/models/kimi_linear``), forward and
forward+backward. On CUDA, our ``kda`` (dispatching to fla) is within 10% of calling
``fla.ops.kda.chunk_kda`` directly, i.e. the wrapper adds no copies.

    python benchmarks/kda_cpu.py                 # CPU: B=2, T=2048, H=4, K=V=64, fp32, 1 thread
    python benchmarks/kda_cpu.py --threads 2     # intra-op threads (all implementations alike)
    python benchmarks/kda_cpu.py --quick         # smoke run (T=256)
    python benchmarks/kda_cpu.py --device cuda   # GPU: B=1, T=8192, H=96, K=V=128, bf16

Inputs: q, k, v ~ N(0, 1); g = kda_gate(f) with random logits (per-step decays spread over
(-5, 0), the K3 safe gate); beta ~ U(0.05, 0.95). Every baseline's output is checked against
ours before it is timed. Times are medians over --repeats runs (a single run for the slow
baselines), interleaved so that load changes on a shared machine hit all rows alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from k3core.ops.kda import kda, kda_gate, naive_kda  # noqa: E402


def make_inputs(B, T, H, K, V, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    f = torch.randn(B, T, H, K, generator=gen)
    A_log = torch.randn(H, generator=gen) * 0.5
    dt_bias = torch.rand(H * K, generator=gen) * 5 - 4
    beta = torch.rand(B, T, H, generator=gen) * 0.9 + 0.05
    g = kda_gate(f, A_log, dt_bias, -5.0)
    out = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, f=f.to(dtype),
               A_log=A_log, dt_bias=dt_bias)
    return {n: x.to(device) for n, x in out.items()}


def transformers_fallback():
    """transformers' torch chunk fallback for Kimi Linear's KDA (undecorated: the hub/fla
    dispatch wrapper is skipped so the torch code itself runs)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as m

    fn = m.chunk_kimi_delta_attention
    return getattr(fn, "__wrapped__", fn)


NAMES = ("q", "k", "v", "g", "beta")


def time_forward(fn, x, sync=None) -> float:
    """Seconds for fn(**x) without autograd."""
    with torch.no_grad():
        if sync:
            sync()
        t0 = time.perf_counter()
        fn(**{n: x[n] for n in NAMES})
        if sync:
            sync()
    return time.perf_counter() - t0


def time_forward_backward(fn, x, sync=None) -> float:
    """Seconds for fn forward plus backward of sum(o * w); leaf copies are made before the clock."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in NAMES}
    w = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(1)).to(x["v"])
    if sync:
        sync()
    t0 = time.perf_counter()
    o = fn(**leaves)
    (o.float() * w).sum().backward()
    if sync:
        sync()
    return time.perf_counter() - t0


def rows_table(title, rows, base):
    print(f"\n{title}")
    print(f"{'implementation':<52}{'forward s':>12}{'fwd+bwd s':>12}{'fwd x':>9}{'fwd+bwd x':>11}")
    bf, bb = rows[base]
    for name, (tf, tb) in rows.items():
        print(f"{name:<52}{tf:>12.4f}{tb:>12.4f}{tf / bf:>9.2f}{tb / bb:>11.2f}")
    print(f"(x = time / time of '{base}'; > 1 means slower than it)")


def cpu(args):
    torch.set_num_threads(args.threads)
    B, T, H, K, V = (2, 256, 4, 64, 64) if args.quick else (2, 2048, 4, 64, 64)
    x = make_inputs(B, T, H, K, V, torch.float32, "cpu")
    x_steep = dict(x, g=x["g"] * 0 - 20.0)  # per-step g = -20 < -5: forces the general Gram path
    hf = transformers_fallback()

    impls = {
        "ours: kda (chunked torch)": lambda q, k, v, g, beta: kda(q, k, v, g, beta)[0],
        "naive_kda (per-token loop)": lambda q, k, v, g, beta: naive_kda(q, k, v, g, beta)[0],
        "transformers chunk_kimi_delta_attention": lambda q, k, v, g, beta: hf(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0],
    }
    slow = {"naive_kda (per-token loop)", "transformers chunk_kimi_delta_attention"}

    print(f"CPU KDA: B={B} T={T} H={H} K={K} V={V} fp32, torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, os.cpu_count()={os.cpu_count()}")
    with torch.no_grad():
        ref = impls["ours: kda (chunked torch)"](**{n: x[n] for n in NAMES})
        for name, fn in impls.items():
            out = fn(**{n: x[n] for n in NAMES})
            err = (out - ref).abs().max().item()
            print(f"  check {name:<45} max|o - o_ours| = {err:.2e}")
            if err > 1e-3:
                raise SystemExit(f"{name} disagrees with ours ({err:.2e}): not comparable")

    times = {name: ([], []) for name in impls}
    steep = ([], [])
    ours = impls["ours: kda (chunked torch)"]
    for rep in range(args.repeats):
        for name, fn in impls.items():
            if name in slow and rep >= args.slow_repeats:
                continue
            times[name][0].append(time_forward(fn, x))
            times[name][1].append(time_forward_backward(fn, x))
        steep[0].append(time_forward(ours, x_steep))
        steep[1].append(time_forward_backward(ours, x_steep))

    rows = {n: (statistics.median(f), statistics.median(b)) for n, (f, b) in times.items()}
    rows["ours, general Gram path (all g = -20)"] = (statistics.median(steep[0]), statistics.median(steep[1]))
    rows_table("CPU, median seconds", rows, "ours: kda (chunked torch)")
    for name, (f, _) in times.items():
        print(f"  {name}: {len(f)} run(s)")


def cuda(args):
    from k3core.ops.kda import _fla

    fla_kda = _fla.require("benchmarks/kda_cpu.py --device cuda").chunk_kda
    B, T, H, K, V = (1, 2048, 16, 128, 128) if args.quick else (1, 8192, 96, 128, 128)
    x = make_inputs(B, T, H, K, V, torch.bfloat16, "cuda")
    sync = torch.cuda.synchronize
    gate = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0)

    def ours_pre(q, k, v, g, beta):
        return kda(q, k, v, g, beta, lower_bound=-5.0)[0]

    def fla_pre(q, k, v, g, beta):
        return fla_kda(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, safe_gate=True)[0]

    def ours_raw(q, k, v, g, beta):
        return kda(q, k, v, g, beta, **gate)[0]

    def fla_raw(q, k, v, g, beta):
        return fla_kda(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                       safe_gate=True, **gate)[0]

    pairs = {
        "pre-gated g (kda_gate outside)": (ours_pre, fla_pre, x),
        "raw gate f (gate fused in fla's kernel)": (ours_raw, fla_raw, dict(x, g=x["f"])),
    }
    print(f"CUDA KDA: B={B} T={T} H={H} K={K} V={V} bf16 q/k/v, fp32 g/beta, {torch.cuda.get_device_name()}")
    for title, (ours, theirs, inp) in pairs.items():
        a = {n: inp[n] for n in NAMES}
        with torch.no_grad():
            o1, o2 = ours(**a), theirs(**a)
        print(f"  check {title}: max|o_ours - o_fla| = {(o1.float() - o2.float()).abs().max().item():.2e}")
        impls = (("ours: kda -> fla", ours), ("fla chunk_kda direct", theirs))
        for _, fn in impls:  # warm-up: triton autotuning and compilation
            for _ in range(3):
                time_forward(fn, inp, sync)
                time_forward_backward(fn, inp, sync)
        rows = {name: ([], []) for name, _ in impls}
        for _ in range(args.repeats * 5):
            for name, fn in impls:
                rows[name][0].append(time_forward(fn, inp, sync))
                rows[name][1].append(time_forward_backward(fn, inp, sync))
        med = {n: (statistics.median(f), statistics.median(b)) for n, (f, b) in rows.items()}
        rows_table(f"CUDA, {title}, median seconds", med, "fla chunk_kda direct")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of our op (median reported)")
    p.add_argument("--slow-repeats", type=int, default=1, help="timed runs of the slow CPU baselines")
    args = p.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 2)
    (cuda if args.device == "cuda" else cpu)(args)


if __name__ == "__main__":
    main()
