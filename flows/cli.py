"""The ``k3rl`` command line.

  k3rl run --preset small --iterations 40 [--env add|reverse|module:factory] [--artifacts URL] [--run-id ID]
  k3rl prepare ...                     fetch, validate, warm up and quantize only
  k3rl model-info --preset full [--json]
  k3rl checkpoint init|fetch|validate|quantize ...
  k3rl plan --preset full --hardware b300 --tokens-per-gpu 100000 [--json]
  k3rl status [--run-id ID] [--artifacts URL]
  k3rl serve | deploy | worker          deployments of prefect.yaml (see flows/deploy.py)

Prefect runs in its embedded mode unless PREFECT_API_URL points at a server; telemetry is off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def _prefect_env() -> None:
    """Prefect's environment is set when ``flows`` is imported (see flows/__init__.py)."""


def _settings_from_args(a):
    from flows.pipeline import RLSettings

    fields = {f.name for f in dataclasses.fields(RLSettings)}
    kw = {k: v for k, v in vars(a).items() if k in fields and v is not None}
    if "source" not in kw:
        kw["source"] = f"init:{kw.get('preset', 'small')}:{kw.get('seed', 0)}"
    return RLSettings(**kw)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    from flows.pipeline import RLSettings

    d = RLSettings()
    p.add_argument("--preset", default=d.preset, help="model preset (tiny, small, medium, full)")
    p.add_argument("--source", default=None, help="checkpoint URL (file://, memory://, s3://, hf://) or init:PRESET[:SEED] "
                   "(default: a fresh seeded checkpoint of --preset)")
    p.add_argument("--env", default=d.env, help="built-in environment (add, reverse) or module.path:factory")
    p.add_argument("--artifacts", default=d.artifacts, help="artifact root: a path or fsspec URL")
    p.add_argument("--run-id", dest="run_id", default=d.run_id, help="re-using a run id resumes that run")
    for f in dataclasses.fields(RLSettings):
        if f.name in ("preset", "source", "env", "artifacts", "run_id"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, type=lambda x: x.lower() in ("1", "true", "yes"), default=None,
                           help=f"(default {f.default})")
        else:
            typ = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(flag, dest=f.name, type=typ, default=None, help=f"(default {f.default})")


def cmd_run(a) -> int:
    _prefect_env()
    from flows.pipeline import rl_run

    s = _settings_from_args(a)
    print(f"k3rl: RL run '{s.run_id}' on preset '{s.preset}', env '{s.env}', {s.iterations} iterations, "
          f"artifacts at {s.artifacts}", flush=True)
    summary = rl_run(s)
    print(json.dumps(summary, indent=2) if a.json else _format_summary(summary))
    return 0


def _format_summary(s: dict) -> str:
    lines = [f"run {s['run_id']}: {s['iterations']} iterations of {s['env']} on '{s['preset']}' in {s['wall_seconds']:.0f} s",
             f"  held-out reward, sampled: {_f(s['heldout_reward_start'])} -> {_f(s['heldout_reward_end'])} "
             f"(solved {_f(s['heldout_solved_start'])} -> {_f(s['heldout_solved_end'])})",
             f"  held-out reward, greedy: {_f(s.get('heldout_greedy_reward_start'))} -> "
             f"{_f(s.get('heldout_greedy_reward_end'))}",
             f"  train reward (sampled): {_f(s['train_reward_first'])} -> {_f(s['train_reward_last'])}",
             "  seconds per stage: " + ", ".join(f"{k} {v}" for k, v in s["seconds_per_stage"].items())]
    return "\n".join(lines)


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def cmd_prepare(a) -> int:
    _prefect_env()
    from flows.pipeline import prepare

    out = prepare(_settings_from_args(a))
    print(json.dumps({k: v for k, v in out.items()}, indent=2, default=str))
    return 0


def cmd_model_info(a) -> int:
    from k3core.config import K3Config
    from k3core.model.info import format_model_info, model_info

    cfg = K3Config.from_json_file(a.config) if a.config else K3Config.preset(a.preset)
    info = model_info(cfg)
    print(json.dumps(info, indent=2) if a.json else format_model_info(a.config or a.preset, info))
    return 0


def cmd_status(a) -> int:
    from k3core.artifacts import ArtifactStore

    store = ArtifactStore(a.artifacts)
    pre = f"runs/{a.run_id}"
    try:
        latest = json.loads(store.read_text(f"{pre}/latest.json"))
    except FileNotFoundError:
        print(f"no run '{a.run_id}' under {a.artifacts} (no latest.json)", file=sys.stderr)
        return 2
    hist = json.loads(store.read_text(f"{pre}/metrics.json")) if store.exists(f"{pre}/metrics.json") else []
    out = {"run_id": a.run_id, "iterations_done": latest["iteration"], "latest_checkpoint": latest["checkpoint"],
           "reward_trend": [round(h["reward_mean"], 3) for h in hist],
           "heldout_trend": [(h["iteration"], round(h["heldout_reward"], 3)) for h in hist if "heldout_reward" in h]}
    print(json.dumps(out, indent=2) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3rl", description="RL post-training for Kimi-K3-architecture models")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="a full RL run (prepare + iterations), Prefect embedded mode by default",
                       epilog="example: k3rl run --preset small --iterations 40 --env add --run-id demo")
    _add_run_args(r)
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.set_defaults(fn=cmd_run)
    pr = sub.add_parser("prepare", help="fetch, validate, warm up and quantize (no RL iterations)")
    _add_run_args(pr)
    pr.set_defaults(fn=cmd_prepare)
    mi = sub.add_parser("model-info", help="parameter counts and bytes from the config (meta device)",
                        epilog="example: k3rl model-info --preset full --json")
    mi.add_argument("--preset", default="full")
    mi.add_argument("--config", default=None, help="a config.json instead of a preset")
    mi.add_argument("--json", action="store_true")
    mi.set_defaults(fn=cmd_model_info)
    st = sub.add_parser("status", help="summarise a run from its artifacts")
    st.add_argument("--run-id", dest="run_id", default="demo")
    st.add_argument("--artifacts", default="./artifacts")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)
    try:
        from k3core.checkpoint.cli import add_checkpoint_subcommands

        add_checkpoint_subcommands(sub)
    except ImportError:
        pass
    from flows.deploy import add_deploy_subcommands

    add_deploy_subcommands(sub)
    try:
        from flows.cli_plan import add_plan_subcommand

        add_plan_subcommand(sub)
    except ImportError:
        pass
    from flows.cli_serve import add_serve_parser  # after deploy: extends its `serve` with --checkpoint

    add_serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = getattr(args, "fn", None) or getattr(args, "func")
    try:
        return handler(args) or 0
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"k3rl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
