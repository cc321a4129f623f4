"""Claim (issue 18): the RL train step reaches at least 30% MFU on one H200, medium preset, at 32k
and 64k tokens per step; and where the rest of the step goes (a profile of the top kernels).

Baseline: 798 TFLOP/s (``--peak-tflops``), the bf16 matmul rate measured on that H200. Ratios:
``MFU = model FLOPs per token x tokens/s / peak``, over the whole step and over its forward+backward
alone (the step minus ``optimizer.step``: the host-side StreamedAdamW), so the optimizer's share shows.

What runs is the loop's own step, ``k3core.rl.train.grpo_train_step``, with ``GRPOSettings()`` (one
update per step: ppo_epochs 1, minibatches 1, so no old-logprob pass; packing; routing replay;
token-mean) except ``--micro-batch-tokens``, and the loop's optimizer (``make_optimizer``:
StreamedAdamW, host-side). The model is ``K3Config.preset(--preset)`` at a seeded random init, cast
with ``model.cast`` to ``--dtype`` (auto: bf16 on cuda, fp32 on cpu, as the loop's ``--dtype``). The
batch is synthetic: prompts of ``--prompt`` tokens, completions drawn from ``--response`` (the last
one or two share what is left), so the input positions (prompt + completion - 1 per sequence, what
the model computes) sum to each ``--tokens`` exactly; rollout logprobs and advantages nonzero;
routing replay through uniformly drawn experts (a balanced router).

``--micro-batch-tokens`` defaults to 8192, not the loop's 0 (the whole step in one forward): with no
activation checkpointing, k3core.plan puts a 32k-token forward of medium far past one H200's memory,
and the split changes the update only by rounding. The planner's figure for the largest micro-batch
(``context_table``, no checkpointing, plus weights and gradients) is printed beside the measured peak.

Model FLOPs per token (``flop_pieces``; training = 3 x forward, one forward+backward per token):
  matmuls  6 x A, A = active parameters minus the input embedding (a lookup): attention projections,
           shared experts, the top-k routed experts (k/E of the routed weights), router, latent
           projections, dense MLP, lm_head (and the short convs, norms, AttnRes vectors: < 0.1%)
  MLA      6 x layers_mla x heads x (qk_head_dim + v_head_dim) x ctx, ctx = the mean number of keys
           a query attends (causal, within its own sequence: sum L(L+1)/2 / sum L); with qk = v = d
           this is the usual 12 x layers x heads x d x ctx
  KDA      3 x layers_kda x heads x (6KV + 5CK + 3CV), the chunked delta rule with chunks of C = 64
           (k3core/ops/kda/chunk.py, fla): the decayed Grams kk^T and qk^T (2CK each), the unit
           triangular solve for [W | U] (C(K+V)), W S, q S and the state update (2KV each), P E (2CV)
Left out: AttnRes mixes, norms, softmaxes, gates (elementwise, well under 1%).

Printed per token count: seconds per step (median of ``--repeats`` after ``--warmup``), tokens/s,
the seconds of ``optimizer.step`` (``torch.cuda.synchronize`` on both sides) and of the rest, called
fwd+bwd (packing, forward, loss, backward, gradient clipping), MFU, and on CUDA
``torch.cuda.max_memory_allocated`` (reset per token count). A token count that runs out of device
memory is reported as such and the next one runs (``--micro-batch-tokens`` bounds the activations,
the [tokens, vocab] fp32 logits above all). ``--profile``: torch.profiler over one more step, the top
15 kernels by self device time grouped by kernel name, then the top host ops (CUDA), or the top 15
ops by self CPU time (CPU). Results, with the command, go in docs/results/train_mfu.md.

    python benchmarks/train_mfu.py --device cuda --preset medium --tokens 32768,65536 --profile
    python benchmarks/train_mfu.py --device cpu --preset tiny --tokens 2048,4096 --repeats 1 --warmup 1
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

GiB = 2**30
KDA_CHUNK = 64  # fla's and k3core.ops.kda.chunk's chunk length


def make_sequences(cfg, tokens: int, prompt: int, response: tuple[int, int], seed: int) -> list:
    """Synthetic rollouts whose input positions sum to ``tokens``: completions drawn from ``response``;
    where what is left would not hold another whole sequence, it is shared by the last one or two."""
    from k3core.rl.train import RLSequence

    g = torch.Generator().manual_seed(seed)
    n_moe, k, E = len(cfg.moe_layers), cfg.num_experts_per_token, cfg.num_experts
    seqs, left = [], tokens
    while left > 0:
        r = int(torch.randint(response[0], response[1] + 1, (1,), generator=g))
        if left - (prompt - 1 + r) < prompt - 1 + response[0]:  # no room for another whole sequence
            r = left - (prompt - 1) if left <= prompt - 1 + response[1] else (left - 2 * (prompt - 1)) // 2
        if r < 1:
            raise ValueError(f"{tokens} tokens do not split into prompts of {prompt} and completions of "
                             f"{response[0]}..{response[1]} tokens")
        n = prompt + r - 1
        ids = torch.randint(0, cfg.vocab_size, (prompt + r,), generator=g).tolist()
        routing = torch.rand(n, n_moe, E, generator=g).topk(k, -1).indices.to(torch.int16)
        logprobs = (-math.log(cfg.vocab_size) + 0.1 * torch.randn(r, generator=g)).tolist()
        seqs.append(RLSequence(ids[:prompt], ids[prompt:], logprobs, float(torch.randn(1, generator=g)), routing))
        left -= n
    return seqs


def flop_pieces(cfg, lengths: list[int]) -> dict[str, float]:
    """Training FLOPs per token of a batch with these input lengths (module docstring), by piece."""
    from k3core.model.info import model_info

    info = model_info(cfg)
    embed = cfg.vocab_size * cfg.hidden_size
    lm_head = embed
    routed = info["routed_active_params"]
    active = info["active_params"] - embed  # the input embedding is a lookup; lm_head is its own weight
    n_mla = sum(cfg.layer_type(i) == "mla" for i in range(cfg.num_hidden_layers))
    n_kda = cfg.num_hidden_layers - n_mla
    ctx = sum(L * (L + 1) / 2 for L in lengths) / sum(lengths)
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    K = V = cfg.kda_head_dim
    C = KDA_CHUNK
    return {"active_params": active, "routed_active_params": routed, "lm_head_params": lm_head,
            "other_params": active - routed - lm_head, "mla_ctx": ctx,
            "matmul": 6.0 * active,
            "mla": 6.0 * n_mla * cfg.num_attention_heads * (qk + v) * ctx,
            "kda": 3.0 * n_kda * cfg.kda_num_heads * (6 * K * V + 5 * C * K + 3 * C * V)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_optimizer_steps(opt, device: torch.device) -> dict:
    """Wrap ``opt.step`` to add its seconds (synchronized on both sides) to the returned dict's "s"."""
    clock, step = {"s": 0.0}, opt.step

    def timed_step(*args, **kwargs):
        sync(device)  # the step already synced on float(grad_norm) just before: this costs nothing
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        sync(device)
        clock["s"] += time.perf_counter() - t0
        return out

    opt.step = timed_step
    return clock


def top_events(events, attr: str, wall: float, top: int) -> list[dict]:
    events = sorted(events, key=lambda e: -getattr(e, attr))[:top]
    return [{"name": e.key, "calls": e.count, "self_s": getattr(e, attr) / 1e6,
             "share": getattr(e, attr) / 1e6 / wall} for e in events]


def print_top(title: str, rows: list[dict]) -> None:
    print(f"  {title}\n  {'self s':>9}{'share':>7}{'calls':>7}  name")
    for r in rows:
        print(f"  {r['self_s']:9.4f}{r['share']:7.1%}{r['calls']:7d}  {r['name'][:100]}")


def profile_step(run_step, device: torch.device, top: int = 15) -> dict:
    """One step under torch.profiler: the ``top`` kernels by self device time grouped by name (CUDA;
    then the top host ops, where the optimizer and syncs show), or the ``top`` ops by self CPU time
    (CPU); shares are of the step's wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        sync(device)
        t0 = time.perf_counter()
        run_step()
        sync(device)
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if not getattr(e, "is_user_annotation", False)]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    out = {"wall_s": wall, "host_top": top_events(host, "self_cpu_time_total", wall, top if not cuda else 8)}
    print(f"\n  profile of one step, {wall:.3f} s")
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        out["device_s"] = sum(e.self_device_time_total for e in kernels) / 1e6
        out["device_top"] = top_events(kernels, "self_device_time_total", wall, top)
        print_top(f"top {top} of the kernels and copies, by self device time: all of them add up to "
                  f"{out['device_s']:.3f} s, {out['device_s'] / wall:.0%} of the step (copy streams overlap "
                  "compute; the device idles while the host works)", out["device_top"])
    print_top("top host ops by self CPU time (the calling thread)", out["host_top"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="the weights' dtype (model.cast), as the loop's --dtype: auto is bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tokens", default="32768,65536", help="comma-separated input positions per step")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    ap.add_argument("--response", type=int, nargs=2, default=(192, 448), help="completion length range")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192,
                    help="GRPOSettings.micro_batch_tokens (0: the loop's default, the whole step in one forward)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=798.0, help="the dense bf16 matmul rate of the device")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the measurements here")
    a = ap.parse_args()
    if a.repeats < 1 or a.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if a.threads:
        torch.set_num_threads(a.threads)

    from k3core.config import K3Config
    from k3core.device import compute_dtype, resolve_device, torch_dtype
    from k3core.model import K3ForCausalLM
    from k3core.plan import context_table
    from k3core.rl.train import grpo_train_step, micro_batches
    from k3core.rl.trainer_state import make_optimizer
    from k3core.settings import GRPOSettings

    device = resolve_device(a.device)
    dtype = torch_dtype(compute_dtype(device, a.dtype))
    settings = GRPOSettings(micro_batch_tokens=a.micro_batch_tokens)
    cfg = K3Config.preset(a.preset)
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = K3ForCausalLM(cfg, init_weights=False)
    model.reset_parameters(a.seed)
    model.cast(dtype)
    opt = make_optimizer(model, settings.lr)
    opt_clock = clock_optimizer_steps(opt, device)
    peak = a.peak_tflops * 1e12
    cuda = device.type == "cuda"
    resident = 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + their gradients

    where = torch.cuda.get_device_name(device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    print(f"preset {a.preset} on {where}, weights {str(dtype).removeprefix('torch.')}, peak {a.peak_tflops:g} TFLOP/s; "
          f"GRPOSettings: packing {settings.packing}, micro_batch_tokens {settings.micro_batch_tokens}, routing replay "
          f"{settings.routing_replay}, {settings.ppo_epochs * settings.minibatches} update(s) per step")
    head = (f"{'tokens':>7}{'seqs':>6}{'mb':>4}{'GFLOP/tok':>10}{'step s':>9}{'fwd+bwd s':>10}{'opt s':>8}"
            f"{'tokens/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'MFU f+b':>8}" + (f"{'peak GiB':>9}{'plan GiB':>9}" if cuda else ""))
    rows, profiles = [], {}
    for T in [int(t) for t in a.tokens.split(",")]:
        seqs = make_sequences(cfg, T, a.prompt, tuple(a.response), a.seed + T)
        lengths = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs]
        f = flop_pieces(cfg, lengths)
        flops = f["matmul"] + f["mla"] + f["kda"]
        largest = max(sum(lengths[i] for i in mb) for mb in micro_batches(lengths, settings.micro_batch_tokens, settings.packing))
        plan = context_table(cfg, largest)["totals"]["no_ac_streaming"] + resident
        print(f"\n{T} tokens, {len(seqs)} sequences; model GFLOP per token {flops / 1e9:.4g} = matmuls 6 x "
              f"{f['active_params'] / 1e6:.2f}M active params {f['matmul'] / 1e9:.4g} (routed experts "
              f"{f['routed_active_params'] / 1e6:.2f}M, lm_head {f['lm_head_params'] / 1e6:.2f}M, the rest "
              f"{f['other_params'] / 1e6:.2f}M) + KDA {f['kda'] / 1e9:.4g} + MLA {f['mla'] / 1e9:.4g} "
              f"(ctx {f['mla_ctx']:.1f} keys per query)\n  largest micro-batch {largest} tokens: k3core.plan "
              f"predicts {plan / GiB:.1f} GiB of device memory (activations, no checkpointing, + weights and "
              f"gradients)", flush=True)

        def run_step():
            return grpo_train_step(model, opt, seqs, settings, cfg.pad_token_id, seq_sum_norm=a.response[1])

        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        steps, opt_s, oom = [], [], None
        try:
            for i in range(a.warmup + a.repeats):
                sync(device)
                opt_clock["s"] = 0.0
                t0 = time.perf_counter()
                m = run_step()
                sync(device)
                if i >= a.warmup:
                    steps.append(time.perf_counter() - t0)
                    opt_s.append(opt_clock["s"])
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        if oom is not None:  # outside the handler: its traceback no longer holds the step's tensors
            print(f"  out of device memory ({oom}); try --micro-batch-tokens", flush=True)
            rows.append({"tokens": T, "sequences": len(seqs), "oom": oom, "largest_micro_batch": largest,
                         "planned_bytes": plan})
            opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        step, fb = statistics.median(steps), statistics.median(s - o for s, o in zip(steps, opt_s))
        rows.append({"tokens": T, "sequences": len(seqs), "micro_batches": m["micro_batches"], "flops": f,
                     "flops_per_token": flops, "steps_s": steps, "optimizer_steps_s": opt_s, "step_s": step,
                     "fwd_bwd_s": fb, "optimizer_s": statistics.median(opt_s), "tokens_per_s": T / step,
                     "mfu": flops * T / step / peak, "mfu_fwd_bwd": flops * T / fb / peak,
                     "max_memory_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
                     "largest_micro_batch": largest, "planned_bytes": plan})
        print(f"  steps {', '.join(f'{s:.3f}' for s in steps)} s, of which optimizer.step "
              f"{', '.join(f'{s:.3f}' for s in opt_s)} s", flush=True)
        if a.profile:
            profiles[T] = profile_step(run_step, device)

    print(f"\nMFU against {a.peak_tflops:g} TFLOP/s (target >= 30%); medians of {a.repeats} step(s) after {a.warmup}")
    print(head)
    for r in rows:
        if "oom" in r:
            print(f"{r['tokens']:>7}{r['sequences']:>6}  out of device memory")
            continue
        print(f"{r['tokens']:>7}{r['sequences']:>6}{r['micro_batches']:>4}{r['flops_per_token'] / 1e9:>10.4g}"
              f"{r['step_s']:>9.3f}{r['fwd_bwd_s']:>10.3f}{r['optimizer_s']:>8.3f}{r['tokens_per_s']:>10.0f}"
              f"{r['mfu'] * a.peak_tflops:>9.3g}{r['mfu']:>7.1%}{r['mfu_fwd_bwd']:>8.1%}"
              + (f"{r['max_memory_allocated'] / GiB:>9.1f}{r['planned_bytes'] / GiB:>9.1f}" if cuda else ""))
    if a.json:
        Path(a.json).write_text(json.dumps({
            "claim": "issue 18: train step MFU >= 30%, medium, one H200", "preset": a.preset, "device": where,
            "dtype": str(dtype), "peak_tflops": a.peak_tflops, "settings": asdict(settings), "prompt": a.prompt,
            "response": list(a.response), "warmup": a.warmup, "repeats": a.repeats, "rows": rows,
            "profiles": profiles}, indent=1))


if __name__ == "__main__":
    main()
