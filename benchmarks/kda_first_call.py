"""The first KDA forward+backward call on CUDA in a fresh process: fla autotuning vs k3rl's shipped
fla configs (``k3core/ops/kda/fla_configs``, read by fla instead of autotuning).

Each case is its own process. The call is the one training makes: ``kda(q, k, v, g, beta,
lower_bound=-5)`` with bf16 q/k/v, fp32 pre-gated g and beta, B=1, then ``.backward()``; default
shape T=8192 and the full model's KDA heads (``K3Config.preset("full")``: H=96, K=V=128).

  autotune  FLA_CACHE_MODE=disabled and an empty Triton cache: fla benchmarks every config of every
            kernel on first use (what each new shape cost before the configs were shipped)
  configs   k3core points fla at the shipped configs, empty Triton cache: no autotuning, but Triton
            still compiles each kernel once (what a fresh machine pays)
  warm      configs again, on the Triton cache the configs case filled (what every later process
            on the same machine pays)

    python3 benchmarks/kda_first_call.py [--T 8192] [--preset full] [--cases autotune,configs,warm]

Prints one line per case and the ratio autotune / configs. Results: docs/results/kda_first_call.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(T: int, preset: str) -> dict:
    t_start = time.perf_counter()
    import torch

    from k3core.config import K3Config
    from k3core.ops.kda import _fla, kda, kda_gate
    from k3core.ops.kda.fla_tune import autotuned_kernels

    cfg = K3Config.preset(preset)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    torch.cuda.init()
    t0 = time.perf_counter()
    assert _fla.available(), "fla must import"
    import_fla_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    f = torch.randn(1, T, H, K, generator=gen).to("cuda", torch.bfloat16)
    A_log = (torch.randn(H, generator=gen) * 0.5).cuda()
    dt_bias = (torch.rand(H * K, generator=gen) * 5 - 4).cuda()
    g = kda_gate(f, A_log, dt_bias, -5.0)
    beta = torch.rand(1, T, H, generator=gen).cuda()
    torch.cuda.synchronize()
    times = []
    for _ in range(2):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        t0 = time.perf_counter()
        o, _ = kda(*leaves, lower_bound=-5.0, backend="fla")
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        o.float().sum().backward()
        torch.cuda.synchronize()
        times.append((t1 - t0, time.perf_counter() - t1))
    tuned = autotuned_kernels()
    return {"T": T, "H": H, "K": K, "gpu": torch.cuda.get_device_name(),
            "FLA_CACHE_MODE": os.environ.get("FLA_CACHE_MODE"), "FLA_CONFIG_DIR": os.environ.get("FLA_CONFIG_DIR"),
            "import_fla_s": import_fla_s, "first_fwd_s": times[0][0], "first_bwd_s": times[0][1],
            "second_fwd_s": times[1][0], "second_bwd_s": times[1][1],
            "tuned_fla": tuned["fla"], "tuned_triton": tuned["triton"],
            "process_s": time.perf_counter() - t_start}


def run_case(case: str, triton_dir: Path, T: int, preset: str, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLA_") and k != "TRITON_CACHE_AUTOTUNING"}
    env.update(TRITON_CACHE_DIR=str(triton_dir), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if case == "autotune":
        env["FLA_CACHE_MODE"] = "disabled"
    cmd = [sys.executable, __file__, "--child", "--T", str(T), "--preset", preset]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": case, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"case": case, "error": f"rc={proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"}
    return {"case": case, "wall_s": wall, **json.loads(lines[-1][len("RESULT "):])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--preset", default="full", help="K3Config preset whose KDA heads are used")
    ap.add_argument("--cases", default="autotune,configs,warm")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per case")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.T, args.preset)), flush=True)
        return 0
    cases = args.cases.split(",")
    scratch = Path(tempfile.mkdtemp(prefix="k3rl_first_call_"))
    results = []
    try:
        for case in cases:
            # autotune and configs each start from an empty Triton cache; warm reuses configs' cache
            triton_dir = scratch / ("configs" if case in ("configs", "warm") else case)
            if case == "warm" and "configs" not in cases:
                raise SystemExit("--cases: warm needs configs before it")
            r = run_case(case, triton_dir, args.T, args.preset, args.timeout)
            results.append(r)
            if "error" in r:
                print(f"{case:9s} ERROR {r['error']}", flush=True)
                continue
            print(f"{case:9s} first fwd {r['first_fwd_s']:7.2f} s  bwd {r['first_bwd_s']:7.2f} s  "
                  f"second fwd+bwd {1e3 * (r['second_fwd_s'] + r['second_bwd_s']):7.1f} ms  "
                  f"import fla {r['import_fla_s']:5.1f} s  process {r['wall_s']:6.1f} s  "
                  f"kernels autotuned: fla {len(r['tuned_fla'])}, plain triton {len(r['tuned_triton'])}",
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ok = {r["case"]: r for r in results if "error" not in r}
    if results and "error" not in results[0]:
        r0 = results[0]
        print(f"shape B=1 T={r0['T']} H={r0['H']} K=V={r0['K']} bf16 on {r0['gpu']}; "
              f"configs: {ok.get('configs', {}).get('FLA_CONFIG_DIR')}")
    if "autotune" in ok and "configs" in ok:
        first = {c: ok[c]["first_fwd_s"] + ok[c]["first_bwd_s"] for c in ("autotune", "configs")}
        print(f"first fwd+bwd: autotune {first['autotune']:.1f} s / configs {first['configs']:.1f} s "
              f"= {first['autotune'] / first['configs']:.1f}x")
        if "warm" in ok:
            warm = ok["warm"]["first_fwd_s"] + ok["warm"]["first_bwd_s"]
            print(f"first fwd+bwd: autotune {first['autotune']:.1f} s / warm {warm:.2f} s "
                  f"= {first['autotune'] / warm:.0f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if len(ok) == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
