"""``k3rl serve --checkpoint DIR``: the rollout engine behind its SGLang-compatible HTTP API.

  k3rl serve --checkpoint DIR [--host 127.0.0.1] [--port 30000] [--dtype float32] [--max-batch 256]
             [--max-queue 4096] [--experts auto|float] [--weight-version 0]

``k3rl serve`` without ``--checkpoint`` keeps its other meaning (serving the Prefect deployments of
prefect.yaml, ``flows/deploy.py``): this module adds the engine's options to that subcommand when it
exists and dispatches on ``--checkpoint``. The server itself is ``k3core.rollout.server``.
"""

from __future__ import annotations


def add_serve_parser(sub) -> None:
    """Register (or extend) the ``serve`` subcommand with the rollout server's options."""
    from k3core.rollout.server import add_arguments

    s = sub.choices.get("serve")
    if s is None:
        s = sub.add_parser("serve", help="serve a checkpoint with the rollout engine's HTTP API (SGLang-compatible)",
                           epilog="example: k3rl serve --checkpoint ckpt/ --port 30000")
        s.set_defaults(fn=cmd_serve, serve_other=None)
    else:
        s.set_defaults(serve_other=s.get_default("fn"), fn=cmd_serve)
        s.description = ("With --checkpoint: serve that checkpoint with the rollout engine's SGLang-compatible HTTP "
                         "API. Without: serve the Prefect deployments of prefect.yaml.")
        s.epilog = ("examples: k3rl serve --checkpoint ckpt/ --port 30000 (rollout engine); "
                    + (s.epilog or "").removeprefix("example: ") + " (deployments)")
    add_arguments(s)


def cmd_serve(args) -> int:
    if getattr(args, "checkpoint", None):
        from k3core.rollout.server import serve

        return serve(args)
    other = getattr(args, "serve_other", None)
    if other is None:
        raise ValueError("--checkpoint is required (a checkpoint directory in the public layout, "
                         "e.g. from `k3rl checkpoint init`)")
    return other(args)
