"""Claim (issue 35 item 1): on CUDA the trainer's packed short convolutions through fla's varlen
kernel and its elementwise regions through torch.compile (``k3core.ops.compiled``: the AttnRes mix,
RMSNorm, the KDA gate) cut the train step's forward+backward time, its kernel launches and its
peak memory, against the eager torch regions measured in the same process.

The loop's own step (``grpo_train_step``, ``GRPOSettings(micro_batch_tokens=8192)``, packing,
routing replay) on train_mfu.py's synthetic batch, at lr 0 so every step sees the same weights and
batch (the loss and gradient norm printed per variant must then agree to rounding). Variants, in
this order, one process: ``eager`` (``FLA_SHORT_CONV`` and ``COMPILED`` off: the tree before),
``fla-conv``, ``fla-conv+compiled`` (the default). Per variant: the first step (compiles included),
the median of ``--repeats`` steps, the optimizer's seconds, kernels per step and their device time
(torch.profiler over one more step), ``torch.cuda.max_memory_allocated``.

    python benchmarks/train_regions.py --device cuda --preset medium --tokens 32768
    python benchmarks/train_regions.py --device cpu --preset tiny --tokens 2048     # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from train_mfu import clock_optimizer_steps, make_sequences, sync  # noqa: E402

VARIANTS = {"eager": (False, False), "fla-conv": (True, False), "fla-conv+compiled": (True, True)}


def kernels_per_step(step) -> tuple[int, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
    ev = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    return sum(e.count for e in ev), sum(e.self_device_time_total for e in ev) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()

    import k3core.model.kda as kda_layer
    import k3core.ops.compiled as regions
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.train import grpo_train_step
    from k3core.rl.trainer_state import make_optimizer
    from k3core.settings import GRPOSettings

    dev = torch.device(a.device)
    cfg = K3Config.preset(a.preset)
    torch.manual_seed(0)
    with dev:
        model = K3ForCausalLM(cfg, init_weights=False)
    model.reset_parameters(0)
    model.cast(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    settings = GRPOSettings(micro_batch_tokens=8192)
    opt = make_optimizer(model, 0.0)
    clock = clock_optimizer_steps(opt, dev)
    seqs = make_sequences(cfg, a.tokens, 64, (192, 448), 0)
    cuda = dev.type == "cuda"
    where = torch.cuda.get_device_name(dev) if cuda else "cpu"
    print(f"preset {a.preset} on {where}, {a.tokens} tokens per step, host kernel {opt.host_kernel}")

    def step():
        sync(dev)
        t = time.perf_counter()
        m = grpo_train_step(model, opt, seqs, settings, cfg.pad_token_id, seq_sum_norm=448)
        sync(dev)
        return time.perf_counter() - t, m

    base = None
    print(f"{'variant':>18}{'first s':>9}{'step s':>8}{'opt s':>7}{'f+b s':>7}{'vs eager':>9}{'kernels':>9}"
          f"{'busy s':>8}{'peak GiB':>9}{'loss':>11}{'grad norm':>11}")
    for name in a.variants.split(","):
        kda_layer.FLA_SHORT_CONV, regions.COMPILED = VARIANTS[name]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            first, m = step()
        except torch.OutOfMemoryError as e:  # the eager regions need more memory: say so, measure the rest
            print(f"{name:>18}  out of memory at {a.tokens} tokens ({str(e).splitlines()[0][:80]})", flush=True)
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        clock["s"] = 0.0
        times = [step()[0] for _ in range(a.repeats)]
        opt_s = clock["s"] / a.repeats
        fb = statistics.median(times) - opt_s
        base = base or (fb if name == "eager" else None)
        n, busy = kernels_per_step(step)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        print(f"{name:>18}{first:9.1f}{statistics.median(times):8.3f}{opt_s:7.3f}{fb:7.3f}"
              + (f"{base / fb:8.2f}x" if base else f"{'-':>9}") + f"{n:9d}"
              f"{busy:8.3f}{peak:9.1f}{m['loss']:11.6f}{m['grad_norm']:11.6f}", flush=True)


if __name__ == "__main__":
    main()
