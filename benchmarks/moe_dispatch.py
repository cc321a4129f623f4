"""Claim: LatentMoE computes only the chosen (token, expert) pairs, so it is faster and smaller than
running every expert on every token (the dense reference, ``dense_reference_moe``).

Same run, same weights and inputs: forward+backward time (median of repeats) and peak extra memory
(CPU: the profiler's allocator events; CUDA: max_memory_allocated) for
  - the small preset's MoE layer (16 experts, top 4, latent 192, expert width 256), and
  - a layer with 64 experts / top 8 (the medium preset's widths),
and the outputs of both paths are checked equal before timing.

    python benchmarks/moe_dispatch.py [--tokens 2048] [--repeats 5] [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3core.config import K3Config
from k3core.model.moe import LatentMoE, dense_reference_moe
from k3core.ops.memory_probe import peak_bytes


def bench(fn, repeats: int, device: str) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_case(name: str, cfg: K3Config, tokens: int, repeats: int, device: str, dtype) -> dict:
    torch.manual_seed(0)
    moe = LatentMoE(cfg).to(device=device, dtype=dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    x = torch.randn(tokens, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)

    def sparse():
        y, _ = moe(x)
        y.float().sum().backward()

    def dense():
        dense_reference_moe(moe, x).float().sum().backward()

    with torch.no_grad():
        ys, yd = moe(x)[0], dense_reference_moe(moe, x)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ys.float(), yd.float(), rtol=tol, atol=tol)
    out = {"case": name, "tokens": tokens, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_token}
    for label, fn in (("sparse", sparse), ("dense", dense)):
        out[f"{label}_ms"] = 1e3 * bench(fn, repeats, device)
        out[f"{label}_peak_mib"] = peak_bytes(fn, device)[1] / 2**20
    out["speedup"] = out["dense_ms"] / out["sparse_ms"]
    out["memory_ratio"] = out["dense_peak_mib"] / max(out["sparse_peak_mib"], 1e-9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.repeats = 256, 2
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    small = K3Config.preset("small")
    med = K3Config.preset("medium")
    wide = small.replace(num_experts=64, num_experts_per_token=8, hidden_size=med.hidden_size,
                         routed_expert_hidden_size=med.routed_expert_hidden_size,
                         moe_intermediate_size=med.moe_intermediate_size)
    rows = [run_case("small preset layer", small, a.tokens, a.repeats, a.device, dtype),
            run_case("64 experts / top 8", wide, a.tokens, a.repeats, a.device, dtype)]
    print(f"device {a.device}, dtype {dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'case':<22}{'E/k':>7}{'tokens':>8}{'sparse ms':>11}{'dense ms':>10}{'speedup':>9}"
          f"{'sparse MiB':>12}{'dense MiB':>11}{'mem ratio':>10}")
    for r in rows:
        print(f"{r['case']:<22}{r['experts']:>4}/{r['top_k']:<2}{r['tokens']:>8}{r['sparse_ms']:>11.1f}{r['dense_ms']:>10.1f}"
              f"{r['speedup']:>8.1f}x{r['sparse_peak_mib']:>12.1f}{r['dense_peak_mib']:>11.1f}{r['memory_ratio']:>9.1f}x")


if __name__ == "__main__":
    main()
