"""Claim (issue 18): the RL loop runs every stage on one GPU, trainer and W4A8 engine sharing it.
Measures one run of the real flow (``flows.pipeline.rl_run``, Prefect embedded mode) on ``--device``
and prints, per stage of the last iteration (the steady state: the live trainer and engine both
resident), its seconds, its peak device memory (``torch.cuda.max_memory_allocated``, reset at the
stage's start), what it left allocated, its host RSS peak, and beside them the memory ledger's
prediction (``k3core.plan.device_ledger``) of what that stage holds:

    rollout, evaluate   engine weights + decode state (static, slots x length as the engine sizes it)
                        + trainer weights (the live trainer stays on the device between iterations)
    train               trainer weights + gradients + engine weights (the engine keeps its weights)
    transfer            trainer weights + engine weights
    mismatch, reference not predicted (bf16 copies and two temporary engines)

The ledger has no activations, so ``peak / ledger`` above 1 is the activations and workspace of the
stage; ``after / ledger`` near 1 checks the resident part. Then per iteration the seconds of each
stage (the first iteration pays kernel compilation and autotuning). Usage, on the H200:

    python benchmarks/gpu_loop.py --device cuda --preset medium --iterations 3
    python benchmarks/gpu_loop.py --device cuda --preset medium --iterations 3 --decode graph --max-staleness 1
    python benchmarks/gpu_loop.py --device cpu --preset tiny --iterations 1 --max-new-tokens 8   # CPU check

Default sizes follow the issue: 16 prompts x 8 samples = 128 rollouts of up to 256 new tokens.
Results, with the command, go in docs/results/gpu_loop.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flows  # noqa: F401,E402  (sets Prefect's environment before it is imported)
from flows.pipeline import rl_run  # noqa: E402
from k3core.settings import DTYPES, RLSettings  # noqa: E402

GiB = 2**30
STAGES = ("evaluate", "rollout", "score", "mismatch", "reference", "train", "save", "transfer")


def static_slots_and_length(sequences: int, longest: int, max_batch: int = 256) -> tuple[int, int]:
    """The static decode state's shape for ``sequences`` running sequences of up to ``longest``
    tokens (prompt + max_new_tokens), as ``k3core.rollout.decode_state.StaticDecode`` sizes it."""
    from k3core.rollout.decode_graphs import bucket

    return bucket(min(sequences, max_batch), max_batch), max(64, 1 << (longest - 1).bit_length())


def stage_ledger(ledger_for, stage: str, steady: bool) -> int | None:
    """Bytes the ledger says ``stage`` holds (None: not predicted). ``ledger_for``: the ledger dict."""
    L = ledger_for
    trainer = L["trainer_weights"] if steady else 0
    if stage in ("rollout", "evaluate"):
        return L["engine_weights"] + L["engine_decode_state"] + trainer
    if stage == "train":
        return L["trainer_weights"] + L["trainer_gradients"] + L["engine_weights"]
    if stage == "transfer":
        return L["trainer_weights"] + L["engine_weights"]
    return None


def _gib(x) -> str:
    return "-" if x is None else f"{x / GiB:8.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu", "auto"))
    ap.add_argument("--dtype", default="auto", choices=DTYPES)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--warmup-steps", type=int, default=25,
                    help="the run's default; 5 left the medium policy at train reward 0.002 on reverse (H200)")
    ap.add_argument("--decode", default="auto", choices=("auto", "dynamic", "static", "graph"),
                    help="the engine's decode mode (auto: static on cuda)")
    ap.add_argument("--max-staleness", type=int, default=0, choices=(0, 1),
                    help="1: the next rollout runs beside the train step and its trainer-state write")
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per evaluation (the final one too)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192,
                    help="train-step token budget per forward/backward (0: the whole batch at once, which the "
                         "planner puts past an H200's memory at medium's 32k+ tokens: AttnRes mixes and fp32 logits)")
    ap.add_argument("--keep-checkpoints", type=int, default=1,
                    help="trainer states kept on disk (each is bf16 weights + fp32 master + moments: 22 GB at medium)")
    ap.add_argument("--env", default="reverse")
    ap.add_argument("--eval-every", type=int, default=1, help="held-out evaluation every N iterations (0: at the end)")
    ap.add_argument("--mismatch-sequences", type=int, default=16,
                    help="rollouts per iteration for the W4A8 mismatch metric (0: skip the stage)")
    ap.add_argument("--mismatch-every", type=int, default=1, help="the mismatch metric every N iterations")
    ap.add_argument("--artifacts", default="build/gpu_loop_artifacts")
    ap.add_argument("--run-id", default=f"gpu-loop-{int(time.time())}")
    ap.add_argument("--json", default=None, help="also write the measurements and predictions here")
    a = ap.parse_args()

    import torch

    from k3core.config import K3Config
    from k3core.device import run_device
    from k3core.plan import device_ledger

    s = RLSettings.from_dict({"device": a.device, "dtype": a.dtype, "preset": a.preset, "iterations": a.iterations,
                              "prompts_per_iteration": a.prompts, "samples_per_prompt": a.samples,
                              "max_new_tokens": a.max_new_tokens, "warmup_steps": a.warmup_steps, "env": a.env,
                              "micro_batch_tokens": a.micro_batch_tokens, "keep_checkpoints": a.keep_checkpoints,
                              "artifacts": a.artifacts, "run_id": a.run_id, "eval_every": a.eval_every, "eval_prompts": a.eval_prompts,
                              "decode": a.decode, "max_staleness": a.max_staleness,
                              "mismatch_sequences": a.mismatch_sequences, "mismatch_every": a.mismatch_every})
    device = run_device(s)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, {torch.cuda.get_device_properties(device).total_memory / GiB:.1f} GiB")
    t0 = time.perf_counter()
    summary = rl_run(s)
    wall = time.perf_counter() - t0
    run = Path(a.artifacts) / "runs" / a.run_id
    history = json.loads((run / "metrics.json").read_text())
    last = history[-1]

    import pyarrow.parquet as pq

    rows = pq.read_table(run / f"iter-{len(history) - 1:04d}" / "rollouts.parquet", columns=["prompt_ids"]).to_pylist()
    longest = max(len(r["prompt_ids"]) for r in rows) + a.max_new_tokens
    slots, length = static_slots_and_length(a.prompts * a.samples, longest)
    config = K3Config.preset(a.preset)
    from k3core.device import run_dtype, torch_dtype

    dtype_bytes = torch_dtype(run_dtype(s)).itemsize  # the trainer's and engine's weights (--dtype; auto: bf16 on cuda)
    ledger = device_ledger(config, trainer_dtype_bytes=dtype_bytes, engine_dtype_bytes=dtype_bytes,
                           quantized=s.rollout.quantized, sequences=slots, context=length)

    print(f"\nrun {a.run_id}: preset {a.preset}, device {device.type}, dtype {run_dtype(s)}, decode {a.decode}, "
          f"max staleness {a.max_staleness}, {len(history)} iterations, wall {wall:.0f} s; "
          f"{a.prompts} x {a.samples} rollouts, {last['rollout_tokens']} generated tokens in the last iteration")
    print("ledger (GiB): " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in ledger.items())
          + f"  [decode state for {slots} slots x {length} tokens]")
    print(f"\nlast iteration (host RSS method: {last.get('memory_host_rss_method')})")
    print(f"{'stage':<10}{'seconds':>9}{'peak GiB':>10}{'after GiB':>10}{'RSS GiB':>9}{'ledger':>9}{'peak/led':>9}{'after/led':>10}")
    steady = len(history) > 1
    table = {}
    for stage in STAGES:
        if f"seconds_{stage}" not in last:
            continue
        peak = last.get(f"memory_{stage}_device_peak_bytes")
        after = last.get(f"memory_{stage}_device_bytes_after")
        rss = last.get(f"memory_{stage}_host_rss_peak_bytes")
        pred = stage_ledger(ledger, stage, steady)
        ratio = lambda x: "-" if not pred or x is None or device.type != "cuda" else f"{x / pred:.2f}"  # noqa: E731
        print(f"{stage:<10}{last[f'seconds_{stage}']:>9.2f}{_gib(peak):>10}{_gib(after):>10}{_gib(rss):>9}"
              f"{_gib(pred):>9}{ratio(peak):>9}{ratio(after):>10}")
        table[stage] = {"seconds": last[f"seconds_{stage}"], "device_peak_bytes": peak, "device_bytes_after": after,
                        "host_rss_peak_bytes": rss, "ledger_bytes": pred}
    print("\nseconds per iteration and stage")
    print(f"{'iter':<6}{'total':>8}" + "".join(f"{st:>10}" for st in STAGES))
    for h in history:
        print(f"{h['iteration']:<6}{h.get('seconds_iteration', 0):>8.1f}"
              + "".join(f"{h.get(f'seconds_{st}', float('nan')):>10.2f}" for st in STAGES))
    print("\nprepare (seconds): " + ", ".join(f"{k} {v}" for k, v in summary["seconds_per_stage"].items()
                                              if k.startswith("prepare_")))
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": s.to_dict(), "device": device.type, "ledger": ledger,
                                            "slots": slots, "length": length, "last_iteration": table,
                                            "history": history, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
