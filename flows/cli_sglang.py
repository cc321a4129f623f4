"""``k3rl sglang-server``: a k3rl checkpoint served by a real SGLang server, started the way k3rl needs it.

  k3rl sglang-server --checkpoint DIR [--host 127.0.0.1] [--port 30000] [--dtype bfloat16]
                     [--quantization auto|none|compressed-tensors] [--weight-version V] [--print-command]
                     [-- extra SGLang arguments]

Runs ``python -m sglang.launch_server`` with ``--skip-tokenizer-init`` (k3rl speaks token ids),
``--enable-return-routed-experts`` (routing replay), the checkpoint's dtype and quantization, a loopback
host unless told otherwise, and the ``attn-res-cw-refresh`` fix switched on
(``k3core.rollout.sglang_fix``). A checkpoint SGLang would compute wrongly is refused before anything
starts (exit 2, with the reasons). SGLang must be installed with its CUDA dependencies on a GPU machine
(``pip install sglang``); the interop extra's ``--no-deps`` install only serves the CPU tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess

COMMAND = "sglang-server"


def add_sglang_server_subcommand(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(COMMAND, help="serve a checkpoint with a real SGLang server (flags and fix k3rl needs)",
                       description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint directory in the public layout (bf16 or MXFP4)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback: SGLang has no authentication)")
    p.add_argument("--port", type=int, default=30000, help="(default 30000)")
    p.add_argument("--dtype", default="bfloat16", help="SGLang --dtype (default bfloat16, the checkpoint's)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "compressed-tensors"],
                   help="auto: compressed-tensors for an MXFP4 checkpoint, none for bf16")
    p.add_argument("--weight-version", dest="weight_version", default=None, help="version SGLang reports")
    p.add_argument("--print-command", dest="print_command", action="store_true",
                   help="print the command and its K3RL_SGLANG_FIXES, start nothing")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more arguments for sglang.launch_server")
    p.set_defaults(fn=cmd_sglang_server)
    return p


def cmd_sglang_server(args: argparse.Namespace) -> int:
    from k3core.rollout import sglang_fix
    from k3core.rollout.sglang_serving import launch_command

    extra = [a for a in args.extra if a != "--"]
    argv, env = launch_command(args.checkpoint, host=args.host, port=args.port, dtype=args.dtype,
                               quantization=args.quantization, weight_version=args.weight_version, extra=extra)
    if args.print_command:
        print(f"{sglang_fix.ENV}={env[sglang_fix.ENV]} {shlex.join(argv)}")
        return 0
    if importlib.util.find_spec("sglang") is None:
        raise FileNotFoundError("SGLang is not installed: on a GPU machine, pip install sglang (with its CUDA "
                                "dependencies), then run this command again")
    return subprocess.run(argv, env=env).returncode
