"""``k3rl rollout-server``: a checkpoint served by the rollout engine behind its SGLang-compatible HTTP API.

  k3rl rollout-server --checkpoint DIR [--host 127.0.0.1] [--port 30000] [--dtype float32] [--max-batch 256]
                      [--max-queue 4096] [--experts auto|float] [--weight-version 0] [--log-level warning]

The HTTP API is ``k3core.rollout.server``, the engine built from the checkpoint
``k3core.rollout.checkpoints.engine_from_checkpoint``. ``k3rl serve`` is another command (the Prefect
deployments of prefect.yaml, ``flows/deploy.py``); given ``--checkpoint`` it refuses and names this
one. ``launch`` starts this command in a subprocess and waits until it answers (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["add_rollout_server_subcommand", "refuse_checkpoint_on_serve", "add_arguments", "cmd_rollout_server",
           "launch"]

COMMAND = "rollout-server"


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's names


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port lies in 0..65535 (0: any free port), got {v}")
    return v


def _at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The rollout server's options (light: nothing heavy is imported to build them)."""
    from k3core.rollout.checkpoints import DTYPES, EXPERTS
    from k3core.rollout.server import DEFAULT_PORT

    p.add_argument("--checkpoint", required=True, help="checkpoint directory in the public layout (bf16 or MXFP4)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback); any other address needs --api-key")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"(default {DEFAULT_PORT}, as SGLang)")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations (default float32)")
    p.add_argument("--max-batch", dest="max_batch", type=_at_least(1), default=256, help="most sequences decoded together")
    p.add_argument("--max-queue", dest="max_queue", type=_at_least(1), default=4096,
                   help="most waiting sequences; beyond it /generate answers 503")
    p.add_argument("--experts", default="auto", choices=EXPERTS,
                   help="auto: an MXFP4 checkpoint runs W4A8 experts; float: dequantise them")
    p.add_argument("--weight-version", dest="weight_version", type=_at_least(0), default=0, help="version of the loaded weights")
    p.add_argument("--log-level", dest="log_level", default="warning", choices=LOG_LEVELS,
                   help="uvicorn's log level (default warning; info logs every request)")
    p.add_argument("--api-key", dest="api_key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
                        "K3RL_ROLLOUT_API_KEY environment variable, which keeps it out of the process list); "
                        "required to bind a non-loopback --host")
    p.add_argument("--weight-root", dest="weight_roots", action="append", default=None, metavar="DIR",
                   help="a directory /update_weights_from_disk may read under (repeatable; default: the "
                        "directory holding --checkpoint and the system temporary directory, where `k3rl run` "
                        "stages its pushes)")
    p.add_argument("--allow-version-rollback", dest="allow_version_rollback", action="store_true",
                   help="accept a weight update older than the served version (a server reused by a new run); "
                        "off: versions only move forward")
    p.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, default=16 << 20,
                   help="largest /generate body; larger answers 413 (default 16 MiB)")
    p.add_argument("--max-update-body-bytes", dest="max_update_body_bytes", type=int, default=256 << 20,
                   help="largest weight-update body (a transfer payload lists every tensor; default 256 MiB)")
    p.add_argument("--max-prompt-tokens", dest="max_prompt_tokens", type=int, default=16384,
                   help="longest prompt in tokens; longer answers 400")
    p.add_argument("--max-new-tokens-cap", dest="max_new_tokens_cap", type=int, default=4096,
                   help="largest sampling_params.max_new_tokens a request may ask; larger answers 400")
    p.add_argument("--max-concurrent-requests", dest="max_concurrent_requests", type=int, default=512,
                   help="/generate requests in flight; one more answers 503 with Retry-After")
    p.add_argument("--max-chat-sessions", dest="max_chat_sessions", type=int, default=4096,
                   help="chat sessions (episode trajectories of /v1/chat/completions) held; past it the least "
                        "recently used is dropped")
    p.add_argument("--body-timeout", dest="body_timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request whose body has not arrived within this answers 408 and frees its slot (default 30)")


def add_rollout_server_subcommand(sub) -> argparse.ArgumentParser:
    """Register ``rollout-server`` on an argparse subparsers object; returns its parser."""
    p = sub.add_parser(COMMAND, help="serve a checkpoint with the rollout engine's HTTP API (SGLang-compatible)",
                       description="Serve a checkpoint with the rollout engine behind the part of SGLang's native "
                                   "HTTP API that RL uses (/generate, /update_weights_from_disk, "
                                   "/update_weights_from_tensor, /health, /get_model_info).")
    add_arguments(p)
    p.set_defaults(fn=cmd_rollout_server)
    return p


class _CheckpointMovedToRolloutServer(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"`k3rl serve` serves the Prefect deployments of prefect.yaml; to serve a "
                                           f"checkpoint with the rollout engine use `k3rl {COMMAND} --checkpoint DIR`")


def refuse_checkpoint_on_serve(sub) -> None:
    """Make ``k3rl serve --checkpoint ...`` a usage error that names ``k3rl rollout-server`` (the
    command that serves a checkpoint) rather than an unrecognised option. Needs ``serve`` registered."""
    serve = sub.choices["serve"]
    serve.add_argument("--checkpoint", action=_CheckpointMovedToRolloutServer, nargs="?", help="not an option of serve (the Prefect deployments): "
                       "a checkpoint is served by `k3rl rollout-server --checkpoint DIR`")


def cmd_rollout_server(args: argparse.Namespace) -> int:
    """Load the checkpoint and serve until interrupted."""
    import uvicorn

    import tempfile

    from k3core.rollout.checkpoints import engine_from_checkpoint
    from k3core.rollout.server import ServerLimits, create_app, is_loopback, tokenizer_for

    api_key = args.api_key or os.environ.get("K3RL_ROLLOUT_API_KEY") or None
    if not is_loopback(args.host) and not api_key:
        print(f"k3rl {COMMAND}: error: --host {args.host} is not a loopback address and there is no API key: anyone "
              f"who reaches it could replace the served weights. Set --api-key (or K3RL_ROLLOUT_API_KEY), or bind "
              f"127.0.0.1", file=sys.stderr)
        return 2
    roots = tuple(args.weight_roots or (str(Path(args.checkpoint).absolute().parent), tempfile.gettempdir()))
    try:
        limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_update_body_bytes=args.max_update_body_bytes,
                              max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens_cap,
                              max_concurrent_requests=args.max_concurrent_requests,
                              max_chat_sessions=args.max_chat_sessions, weight_roots=roots,
                              allow_version_rollback=args.allow_version_rollback, body_timeout_s=args.body_timeout)
    except ValueError as e:
        print(f"k3rl {COMMAND}: error: {e}", file=sys.stderr)
        return 2
    if not (Path(args.checkpoint) / "config.json").is_file():
        raise FileNotFoundError(f"{args.checkpoint}: no config.json; point --checkpoint at a checkpoint directory in "
                                "the public layout (e.g. one made by `k3rl checkpoint init`)")
    engine = engine_from_checkpoint(args.checkpoint, args.dtype, args.experts, args.weight_version,
                                    args.max_batch, args.max_queue)
    app = create_app(engine, tokenizer_for(engine.config, str(args.checkpoint)), str(args.checkpoint), limits=limits, api_key=api_key)
    print(f"k3rl: serving {args.checkpoint} (weight version {engine.weight_version}) on http://{args.host}:{args.port}"
          f"{' (API key required)' if api_key else ''}; weight updates from disk under {', '.join(roots)}",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def launch(checkpoint: str | Path, *args: str, log_path: str | Path, env: dict | None = None,
           ready_timeout: float = 90.0, **client_kw):
    """Start ``k3rl rollout-server --checkpoint CHECKPOINT --port P ARGS`` (this interpreter) on a free
    loopback port, wait until ``/health`` answers, and return ``(process, RolloutClient)``. Output
    goes to ``log_path``; a server that exits or stays silent past ``ready_timeout`` raises with its
    log. The caller terminates the process."""
    from k3core.rollout.client import RolloutClient

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", COMMAND, "--checkpoint", str(checkpoint),
                                 "--port", str(port), *args], env={**os.environ, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT)
    client = RolloutClient(f"http://127.0.0.1:{port}", **client_kw)
    deadline = time.monotonic() + ready_timeout
    while not client.health():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rollout server did not start (exit {proc.wait()}):\n{Path(log_path).read_text()}")
        time.sleep(0.2)
    return proc, client
