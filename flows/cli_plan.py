"""``k3rl plan``: what a K3 config costs on a cluster, from the config alone (``k3core.plan``).

    k3rl plan --preset full --hardware b300 --tokens-per-gpu 100000 [--json]
    k3rl plan --config path/to/config.json --hardware my_node.yaml --tp 8 --ep 64 --pp 8 --fsdp
    k3rl plan --preset full --pp 3 --pp-layout 32,32,29

Wiring: ``add_plan_subcommand(subparsers)`` registers the subcommand on an argparse subparsers
object and sets ``func=run_plan``; ``run_plan(args)`` prints the table (or JSON) and returns the
exit status (2 with a one-line error for bad input).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_plan_subcommand", "run_plan"]


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 32,32,29, got {text!r}") from None


def add_plan_subcommand(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="memory, GPUs, engine and checkpoint cost of a K3 config on a cluster (on paper)",
        description="Plan a K3 config on a cluster from the config alone: parameter- and context-shaped "
                    "bytes, GPUs per training replica with and without the streaming optimisations, rollout "
                    "engine nodes, checkpoint save time, pipeline layouts. GB = 1e9 bytes.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=["tiny", "small", "medium", "full"], help="named config (default: full)")
    src.add_argument("--config", metavar="FILE", help="a Kimi K3 config.json")
    p.add_argument("--hardware", default="h200", metavar="NAME|FILE",
                   help="built-in node (h200, b300) or a JSON/YAML node description (default: h200)")
    p.add_argument("--tokens-per-gpu", type=_positive_int, default=100000, metavar="N",
                   help="tokens per GPU in one micro-batch, after the CP and sequence-parallel splits (default: 100000)")
    for name in ("tp", "ep", "pp", "cp", "dp"):
        p.add_argument(f"--{name}", type=_positive_int, default=1, metavar="N", help=f"{name.upper()} degree (default 1)")
    p.add_argument("--fsdp", action="store_true", help="shard weights and gradients over the data-parallel GPUs")
    p.add_argument("--pp-layout", type=_int_list, metavar="N,N,...",
                   help="explicit decoder layers per pipeline stage (default: aligned to AttnRes blocks)")
    p.add_argument("--elementwise", choices=["eager", "fused"], default="eager",
                   help="eager = k3core today (RMSNorm/AttnRes/conv keep fp32 copies); fused = fused kernels")
    p.add_argument("--logits-chunk", type=int, default=0, metavar="N",
                   help="0 = full [T, vocab] logits (k3core today); N = fused loss over N-token chunks")
    p.add_argument("--no-activation-checkpointing", action="store_true",
                   help="size replicas without per-layer activation checkpointing")
    p.add_argument("--fs-gbps", type=float, metavar="GB/s", help="filesystem write bandwidth (default: the hardware's)")
    p.add_argument("--engine-sequences", type=_positive_int, default=128, metavar="N",
                   help="concurrent sequences of the rollout engine (default 128)")
    p.add_argument("--engine-context", type=_positive_int, default=32768, metavar="N",
                   help="context tokens per engine sequence (default 32768)")
    p.add_argument("--sweep-tokens", type=_int_list, default=[], metavar="N,N,...",
                   help="also size replicas at these tokens per GPU")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace, out=None, err=None) -> int:
    from k3core.config import K3Config
    from k3core.plan import Kernels, Layout, format_plan, plan

    out = out or sys.stdout
    err = err or sys.stderr
    try:
        if args.config:
            config, name = K3Config.from_json_file(args.config), args.config
        else:
            name = args.preset or "full"
            config = K3Config.preset(name)
        layout = Layout(tp=args.tp, ep=args.ep, pp=args.pp, cp=args.cp, dp=args.dp, fsdp=args.fsdp,
                        pp_layout=tuple(args.pp_layout) if args.pp_layout else None)
        kernels = Kernels(elementwise=args.elementwise, logits_chunk=args.logits_chunk)
        result = plan(config, args.hardware, args.tokens_per_gpu, layout, kernels=kernels,
                      ac=not args.no_activation_checkpointing, fs_gbps=args.fs_gbps,
                      engine_sequences=args.engine_sequences, engine_context=args.engine_context,
                      sweep_tokens=args.sweep_tokens)
    except (ValueError, OSError) as e:
        print(f"k3rl plan: error: {e}", file=err)
        return 2
    if args.json:
        json.dump(result, out, indent=2)
        out.write("\n")
    else:
        out.write(format_plan(result, config_name=name) + "\n")
    return 0
