"""Claim: the rollout engine's cached decode (constant KDA state, MLA latent cache in absorbed form,
continuous batching) is much faster than recomputing the whole sequence for every new token, and its
decode state per sequence stays small: constant for the KDA layers, one latent per token for MLA.

Same run, same weights and prompts (greedy):
  - decode tokens/s at each batch size: the engine (``RolloutEngine``: prefill once, then one cached
    decode step per token) in each decode mode (``--modes``: "dynamic", the reshaped ``K3Cache`` and
    an ordinary forward per step; "static", fixed shapes run eagerly; "graph", the static step replayed
    as a CUDA graph) vs the no-cache baseline (a full forward over prompt + generated tokens for every
    new token, the same model otherwise). Decode-only: the first step (prefill + first token, and the
    graph capture) is excluded from all;
  - agreement, at the first decode step (random-init logits are near ties, so in bf16 one flipped
    greedy token makes whole sequences differ from there on; the first step is the comparison that
    means something): the fraction of rows whose first decoded token equals the no-cache baseline's,
    and the max |logit difference| there, of the last mode against the baseline and of every mode
    against the first; whole-sequence equality beside it;
  - greedy agreement of every mode with the no-cache forward on a checkpoint that can show it
    (``--agreement``, default on): the `small` preset after 25 supervised warm-up steps (CPU, fp32,
    then cast and moved like the speed model, experts likewise), 16 held-out `reverse` prompts through
    max_batch 4, the decoded token judged against the forward's argmax at every position
    (``k3core.rollout.agreement``; the criterion is 99%);
  - decode-state bytes per sequence vs length (KDA / MLA, measured on a real cache), beside what the
    same depth would hold as all-MLA latents and as a plain multi-head KV cache;
  - with ``--device cuda``: the engine's tokens/s at the largest batch against the memory roofline of
    a decode step (bytes it must read: every weight except the embedding table, which is gathered,
    plus the KDA state read and written and the MLA latents read) at the HBM copy bandwidth measured
    in the same run.

    python benchmarks/rollout_decode.py [--preset small] [--batches 1,16,64] [--quick]
    python benchmarks/rollout_decode.py --device cuda --preset medium --batches 1,64,256 --experts w4a8   # issue 16
    python benchmarks/rollout_decode.py --device cuda --preset medium --batches 64 --profile

``--profile``: torch.profiler over a few engine steps (decode + sampling) of each mode at the largest
batch: the top ops by self device time (self CPU time on CPU), and per step the kernels run on the
device, the kernel/graph launches issued by the host and the aten ops dispatched.
"""

from __future__ import annotations

import argparse
import time

import torch

from k3core.config import K3Config
from k3core.model import K3Cache, K3ForCausalLM
from k3core.rollout.engine import RolloutEngine, SamplingParams

LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_model(preset: str, device: str, dtype: torch.dtype, experts: str) -> K3ForCausalLM:
    from k3core.checkpoint.names import materialize, meta_model

    config = K3Config.preset(preset)
    model = materialize(meta_model(config), device)
    model.reset_parameters(seed=0)
    model.cast(dtype)
    if experts == "w4a8":
        from k3core.rollout.quantized import quantize_engine_model

        quantize_engine_model(model, "token")
    return model


def engine_decode(model, prompts: torch.Tensor, new_tokens: int, device: str,
                  mode: str) -> tuple[float, list[list[int]], dict, torch.Tensor]:
    """Decode-only seconds for tokens 2..new_tokens with the engine in decode ``mode``, the outputs,
    cache stats at the end and the first decode step's logits ``[B, V]`` (fp32, CPU)."""
    eng = RolloutEngine(model, max_batch=max(1, prompts.shape[0]), decode=mode)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    futures = [eng.submit(p.tolist(), sp) for p in prompts]
    eng.step()  # prefill + first token + the first decode forward (and its graph capture)
    first = eng._logits.float().cpu()  # that forward's output: rows in submission order (none left yet)
    sync(device)
    t0 = time.perf_counter()
    stats = eng.cache_stats()
    while eng.load()["running"]:
        stats = eng.cache_stats()
        eng.step()
    sync(device)
    dt = time.perf_counter() - t0
    return dt, [f.result()[0].output_ids for f in futures], stats, first


@torch.no_grad()
def nocache_decode(model, prompts: torch.Tensor, new_tokens: int, device: str) -> tuple[float, list[list[int]], torch.Tensor]:
    """The baseline: every new token recomputes the full forward over prompt + tokens so far.
    Also returns the logits of step 1 (the first decode step) ``[B, V]`` (fp32, CPU)."""
    ids = prompts.to(device)
    out = []
    t0 = None
    first = None
    for step in range(new_tokens):
        if step == 1:
            sync(device)
            t0 = time.perf_counter()
        logits = model(ids).logits[:, -1].float()
        if step == 1:
            first = logits.cpu()
        tok = logits.argmax(-1, keepdim=True)
        out.append(tok)
        ids = torch.cat([ids, tok], 1)
    sync(device)
    dt = time.perf_counter() - t0 if t0 is not None else 0.0
    return dt, torch.cat(out, 1).tolist(), first


def first_step_agreement(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[float, float]:
    """(fraction of rows with the same argmax, max |a - b|) of two first-decode-step logits."""
    if a is None or b is None:
        return float("nan"), float("nan")
    return float((a.argmax(-1) == b.argmax(-1)).double().mean()), float((a - b).abs().max())


def profile_steps(model, prompts: torch.Tensor, mode: str, device: str, steps: int, rows: int = 15) -> None:
    """torch.profiler over ``steps`` engine steps (decode + sampling) after prefill and capture."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    eng = RolloutEngine(model, max_batch=prompts.shape[0], decode=mode)
    sp = SamplingParams(max_new_tokens=steps + 3, temperature=0)
    for p in prompts:
        eng.submit(p.tolist(), sp)
    eng.step()
    eng.step()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        sync(device)
    while eng.step():
        pass
    ev = prof.events()
    kernels = sum(e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")) for e in ev)
    launches = sum(e.name in LAUNCH_APIS for e in ev)
    aten = sum(e.device_type == DeviceType.CPU and e.name.startswith("aten::") for e in ev)
    print(f"\nprofile: decode mode {mode}, batch {prompts.shape[0]}, {steps} engine steps (decode + sampling)")
    print(f"  per step: {kernels / steps:.0f} device kernels, {launches / steps:.0f} host launches "
          f"(kernels + graphs), {aten / steps:.0f} aten ops (nested included)")
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows))


@torch.no_grad()
def memory_per_sequence(model, lengths: list[int], device: str) -> list[dict]:
    cfg = model.config
    n_mla = sum(cfg.layer_type(i) == "mla" for i in range(cfg.num_hidden_layers))
    elem = model.lm_head.weight.element_size()
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem  # one MLA latent per token and layer
    mha = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * elem
    rows = []
    for L in lengths:
        cache = K3Cache.empty(cfg)
        ids = torch.randint(0, min(cfg.vocab_size, 256), (1, L), device=device)
        model(ids, cache=cache, return_logits=False)
        rows.append({"length": L, "kda_bytes": cache.kda_nbytes(), "mla_bytes": cache.mla_nbytes(),
                     "total": cache.kda_nbytes() + cache.mla_nbytes(),
                     "all_mla_latent": cfg.num_hidden_layers * L * latent,
                     "all_mha_kv": cfg.num_hidden_layers * L * mha, "mla_layers": n_mla})
        del cache
    return rows


def hbm_copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s moved by a device-to-device copy (read + write counted), median of repeats."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def step_bytes(model, batch: int, stats: dict) -> tuple[int, int]:
    """(weight bytes a decode step reads, decode-state bytes it moves) at the cache state ``stats``."""
    own = list(model.named_parameters()) + list(model.named_buffers())
    total = sum(t.numel() * t.element_size() for n, t in own if t is not None and not n.endswith("_site.cache"))
    emb = model.model.embed_tokens.weight
    weights = total - emb.numel() * emb.element_size() + batch * emb.shape[1] * emb.element_size()
    state = 2 * int(stats["kda_bytes"]) + int(stats["mla_bytes"])  # KDA state read + written, latents read
    return weights, state


def print_agreement(modes: list[str], device: str, dtype: torch.dtype, experts: str) -> None:
    """Greedy agreement of each decode mode with the no-cache forward on the warmed-up `small` model."""
    import copy

    from k3core.rl.data import heldout_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.warmup import warmed_up_model
    from k3core.rollout.agreement import greedy_agreement, greedy_outputs
    from k3core.tokenizer import ByteTokenizer

    cfg = K3Config.preset("small")
    t0 = time.perf_counter()
    model = warmed_up_model(cfg, steps=25, seed=0).to(device).cast(dtype).eval()
    if experts == "w4a8":
        from k3core.rollout.quantized import quantize_engine_model

        quantize_engine_model(model, act_granularity="token")
    model.use_inference_caches = True
    model.refresh_inference_caches()
    tok = ByteTokenizer(cfg)
    prompts = [tok.encode(p) for p in heldout_prompts(load_env("reverse"), 0, 16, "reverse")]
    print(f"\ngreedy agreement with the no-cache forward: small preset warmed up 25 steps "
          f"({time.perf_counter() - t0:.0f} s), {str(dtype).removeprefix('torch.')}, experts {experts}, "
          "16 held-out reverse prompts x 24 new tokens, max_batch 4 (criterion: 99%)")
    for mode in modes:
        got = greedy_agreement(model, prompts, greedy_outputs(copy.deepcopy(model), prompts, mode))
        print(f"  {mode:>8}: {got.describe()}")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--experts", default="float", choices=["float", "w4a8"], help="routed experts as the engine runs them")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--baseline-max-batch", type=int, default=64, help="skip the no-cache baseline above this batch")
    ap.add_argument("--lengths", default="128,512,2048", help="sequence lengths for the memory table")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--roofline", action="store_true", help="print the roofline comparison (always on with CUDA)")
    ap.add_argument("--modes", default=None,
                    help="engine decode modes, comma-separated (default dynamic,static,graph on CUDA; dynamic on CPU)")
    ap.add_argument("--profile", action="store_true", help="profile a few decode steps of each mode at the largest batch")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--profile-rows", type=int, default=15, help="rows of the profile table")
    ap.add_argument("--w4a8-decode", default="both", choices=["both", "hw_cvt", "scale_once", "neither"],
                    help="the W4A8 kernel's decode variant (grouped_mm_triton.KernelConfig; default both)")
    ap.add_argument("--agreement", action=argparse.BooleanOptionalAction, default=True,
                    help="greedy agreement of each mode with the no-cache forward on a warmed-up small checkpoint")
    ap.add_argument("--quick", action="store_true", help="batches 1,16, 8 new tokens, short prompts and lengths")
    a = ap.parse_args()
    if a.w4a8_decode != "both" and a.experts == "w4a8":
        from k3core.ops.w4a8 import grouped_mm_triton

        grouped_mm_triton.HW_CVT = a.w4a8_decode == "hw_cvt"
        grouped_mm_triton.SCALE_ONCE = a.w4a8_decode == "scale_once"
    if a.quick:
        a.batches, a.new_tokens, a.prompt_len, a.lengths = "1,16", 8, 16, "64,256"
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device == "cuda" else torch.float32)
    batches = [int(b) for b in a.batches.split(",")]
    cuda_modes = "dynamic,static,graph"  # W4A8 experts too: their Triton kernel tiles on the device
    modes = (a.modes or (cuda_modes if a.device == "cuda" else "dynamic")).split(",")
    model = build_model(a.preset, a.device, dtype, a.experts).eval()
    cfg = model.config
    print(f"preset {a.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters), {a.device}, "
          f"{str(dtype).removeprefix('torch.')}, experts {a.experts}, threads {torch.get_num_threads()}, "
          f"prompt {a.prompt_len} tokens, {a.new_tokens} new tokens (greedy), decode modes {', '.join(modes)}")
    g = torch.Generator().manual_seed(0)
    rows = []
    last = modes[-1]
    for B in batches:
        prompts = torch.randint(0, min(cfg.vocab_size, 256), (B, a.prompt_len), generator=g)
        row = {"batch": B, "tok_s": {}, "first": {}, "out": {}}
        tokens = B * (a.new_tokens - 1)
        for mode in modes:
            t_eng, row["out"][mode], row["stats"], row["first"][mode] = engine_decode(model, prompts, a.new_tokens,
                                                                                      a.device, mode)
            row["tok_s"][mode] = tokens / t_eng
        row["cached_tok_s"] = row["tok_s"][last]
        if B <= a.baseline_max_batch:
            model.use_inference_caches = True  # same forward as the engine, without K3Cache
            t_nc, out_nc, first_nc = nocache_decode(model, prompts, a.new_tokens, a.device)
            row["nocache_tok_s"] = tokens / t_nc
            row["first_equal"], row["first_diff"] = first_step_agreement(row["first"][last], first_nc)
            row["same_tokens"] = sum(x == y for x, y in zip(row["out"][last], out_nc)) / B
        rows.append(row)
    print(f"\ndecode tokens/s (excluding prefill + first token); agreement of {last} with no-cache at the first decode step")
    head = "".join(f"{m:>10}" for m in modes)
    print(f"{'batch':>6}{head} {'no-cache':>10} {'speedup':>8} {'1st tok =':>10} {'1st max|dl|':>12} {'same seq':>9}")
    nan = float("nan")
    for r in rows:
        nc = r.get("nocache_tok_s")
        cols = "".join(f"{r['tok_s'][m]:>10.1f}" for m in modes)
        print(f"{r['batch']:>6}{cols} {nc if nc else nan:>10.1f} {r['cached_tok_s'] / nc if nc else nan:>7.1f}x "
              f"{r.get('first_equal', nan):>10.2f} {r.get('first_diff', nan):>12.3g} {r.get('same_tokens', nan):>9.2f}")
    if len(modes) > 1:
        print(f"\nfirst decode step, each mode against {modes[0]}: fraction of equal tokens, max |logit diff|, "
              "whole sequences equal")
        for r in rows:
            for m in modes[1:]:
                eq, diff = first_step_agreement(r["first"][m], r["first"][modes[0]])
                same = sum(x == y for x, y in zip(r["out"][m], r["out"][modes[0]])) / r["batch"]
                print(f"  batch {r['batch']:>4} {m:>8}: {eq:.2f} {diff:.3g} {same:.2f}")
    if a.agreement:
        print_agreement(modes, a.device, dtype, a.experts)
    lengths = [int(x) for x in a.lengths.split(",")]
    mem = memory_per_sequence(model, lengths, a.device)
    print(f"\ndecode state per sequence ({mem[0]['mla_layers']} MLA of {cfg.num_hidden_layers} layers; "
          "K3 = KDA state + MLA latents)")
    print(f"{'length':>7} {'KDA':>11} {'MLA':>11} {'K3 total':>11} {'all-MLA latent':>15} {'all-MHA KV':>12}")
    for m in mem:
        print(f"{m['length']:>7} {fmt_bytes(m['kda_bytes']):>11} {fmt_bytes(m['mla_bytes']):>11} "
              f"{fmt_bytes(m['total']):>11} {fmt_bytes(m['all_mla_latent']):>15} {fmt_bytes(m['all_mha_kv']):>12}")
    if a.device == "cuda" or a.roofline:
        bw = hbm_copy_bandwidth(a.device, (1 << 30) if a.device == "cuda" else (1 << 28))
        r = rows[-1]
        w, s = step_bytes(model, r["batch"], r["stats"])
        roof_w = r["batch"] / (w / bw)
        roof_ws = r["batch"] / ((w + s) / bw)
        mem_kind = "HBM" if a.device == "cuda" else "DRAM"
        print(f"\nroofline at batch {r['batch']}: {mem_kind} copy bandwidth {bw / 1e9:.0f} GB/s (measured); "
              f"a decode step reads "
              f"{w / 1e9:.2f} GB of weights and moves {s / 1e9:.3f} GB of decode state")
        print(f"  measured {r['cached_tok_s']:.0f} tok/s; roofline {roof_w:.0f} tok/s (weights only), "
              f"{roof_ws:.0f} tok/s (weights + state): {100 * r['cached_tok_s'] / roof_ws:.1f}% of the roofline "
              f"(decode mode {last})")
    if a.profile:
        prompts = torch.randint(0, min(cfg.vocab_size, 256), (batches[-1], a.prompt_len), generator=g)
        for mode in modes:
            profile_steps(model, prompts, mode, a.device, a.profile_steps, a.profile_rows)


if __name__ == "__main__":
    main()
