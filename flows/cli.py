"""The ``k3rl`` command line.

  k3rl run --preset small --iterations 40 [--env add|reverse|module:factory] [--artifacts URL] [--run-id ID]
  k3rl prepare ...                     fetch, validate, warm up and quantize only
  k3rl model-info --preset full [--json]
  k3rl checkpoint init|fetch|validate|quantize ...
  k3rl plan --preset full --hardware b300 --tokens-per-gpu 100000 [--json]
  k3rl status [--run-id ID] [--artifacts URL]
  k3rl serve | deploy | worker          deployments of prefect.yaml (see flows/deploy.py)
  k3rl rollout-server --checkpoint DIR  a checkpoint behind the SGLang-style HTTP API (flows/cli_serve.py)
  k3rl sglang-server --checkpoint DIR   a checkpoint served by real SGLang with the fix k3rl needs (flows/cli_sglang.py)

Run settings (``k3rl run --help``) are the sections of ``k3core.settings.RLSettings``, one flag each.

Prefect runs in its embedded mode unless PREFECT_API_URL points at a server; telemetry is off.

Exit status (every subcommand): 0 success; 1 the work failed (a run or stage raised, a checkpoint
failed validation); 2 bad usage or input (unknown option, preset or environment, a run or file that
does not exist, storage access denied or a bucket that does not exist); 130 interrupted (Ctrl-C;
``k3rl run`` resumes with the same command).

Errors are one message naming the problem and the fix, without a traceback; ``k3rl --debug ...``
(the flag may also follow the subcommand) prints the traceback as well.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import signal
import sys
import traceback

from flows.preflight import check_settings


def new_run_id() -> str:
    """A fresh run id when ``--run-id`` is not given: readable, sortable by start time, unique enough
    for runs started within the same second (four random hex digits), and inside the run-id
    alphabet (``PipelineSettings``)."""
    import secrets
    import time

    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _settings_from_args(a: argparse.Namespace):
    """``RLSettings`` from the run flags given (the rest keep their defaults; a run without
    ``--run-id`` gets ``new_run_id()``, never a shared default that would silently resume another
    run); every problem of every section in one ``SettingsError`` (a ``ValueError``: exit status 2)."""
    from k3core.settings import RLSettings, section_fields

    if getattr(a, "pipeline__run_id", None) is None:
        a.pipeline__run_id = new_run_id()
        a.run_id_generated = True
    nested: dict[str, dict] = {}
    for sec, f in section_fields():
        value = getattr(a, f"{sec}__{f.name}", None)
        if value is not None:
            nested.setdefault(sec, {})[f.name] = value
    return RLSettings.from_dict(nested)


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped by section (``k3rl run --help`` shows the sections)."""
    from k3core.settings import section_fields

    # argparse takes "-1e-4" or "-inf" for an option (its negative-number pattern has no exponent),
    # so `--lr -1e-4` would fail with "expected one argument" instead of the setting's own check.
    if hasattr(p, "_negative_number_matcher"):
        p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.I)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for sec, f in section_fields():
        g = groups.get(sec) or groups.setdefault(sec, p.add_argument_group(f"{sec} settings"))
        flag, kind = "--" + f.metadata["flag"], f.metadata["kind"]
        dest = f"{sec}__{f.name}"
        default = f.default if f.default != "" else "init:PRESET:SEED"
        text = f"{f.metadata['help']} (default {str(default).lower() if kind == 'bool' else default})"
        if dest == "pipeline__run_id":  # the CLI names a new run itself (``new_run_id``) instead of the default
            text = f"{f.metadata['help']} (default: a new id, run-YYYYmmdd-HHMMSS-xxxx, printed at the start)"
        metavar = f.metadata["flag"].upper().replace("-", "_")  # RUN_ID, not the section-qualified dest
        if kind == "bool":  # --qat alone means true; --qat false|true|0|1|no|yes also parse
            g.add_argument(flag, dest=dest, type=_bool, nargs="?", const=True, default=None, help=text, metavar=metavar)
        else:
            g.add_argument(flag, dest=dest, type={"int": int, "float": float}.get(kind, str), default=None, help=text,
                           metavar=metavar)


def _bool(text: str) -> bool:
    v = text.lower()
    if v not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return v in ("1", "true", "yes")


def cmd_run(a) -> int:
    s = _settings_from_args(a)
    check_settings(s)
    from flows.runlock import run_lock

    run_id, artifacts = s.pipeline.run_id, s.pipeline.artifacts
    with run_lock(artifacts, run_id) as lock:  # two runs on one id would interleave their stages
        if not lock:
            holder = f"pid {lock.holder}" if lock.holder else "another process"
            print(f"k3rl: error: run '{run_id}' is busy: {holder} (a `k3rl run` or scheduled tick of it) holds "
                  f"{lock.path}; wait for it to finish, or use another --run-id", file=sys.stderr)
            return 2
        if lock.took_over_from:
            print(f"k3rl: run '{run_id}': took over {lock.path} from pid {lock.took_over_from}, which died holding "
                  "it; resuming", file=sys.stderr)
        return _run_locked(a, s, lock.path)


def resume_command(argv: list[str], run_id: str) -> str:
    """The command that resumes this run: the same arguments, with ``--run-id`` named."""
    import shlex

    has_id = any(x == "--run-id" or x.startswith("--run-id=") for x in argv)
    return shlex.join(["k3rl", *argv, *([] if has_id else ["--run-id", run_id])])


def _run_locked(a, s, lock_file) -> int:
    """The run, holding its lock: a finished run replays its summary; otherwise first clear what a
    killed process of it left (``flows.resume``)."""
    from flows import resume

    checked = not resume.has_summary(s)  # not a replay of a finished run, which starts no server
    if checked:
        resume.check_prefect_environment()
        resume.launch_embedded_server()  # imports beside this process's imports; waited for below
    from prefect import tags

    from flows.console import progress_wanted, run_progress, stage_heartbeat
    from flows.pipeline import rl_run

    from k3core.device import run_device

    run_id = s.pipeline.run_id
    print(f"k3rl: RL run '{run_id}'{' (a new run id)' if getattr(a, 'run_id_generated', False) else ''} on preset "
          f"'{s.model.preset}', env '{s.pipeline.env}', {s.pipeline.iterations} iterations, device "
          f"{run_device(s).type}, artifacts at {s.pipeline.artifacts}\n"
          f"k3rl: to resume or continue it: {resume_command(a.argv, run_id)}", file=sys.stderr, flush=True)
    from flows.estimate import estimate_line
    from flows.reports import finished_iterations, finished_summary

    finished_iterations(s)  # a record that is not k3rl's (RunRecordError): one line naming it, before any work
    summary = finished_summary(s)
    if summary is not None:  # a replay of a finished run: no Prefect server, no stage, no record rewritten
        print(f"k3rl: run '{run_id}' finished its {summary['iterations']} iterations already; its recorded summary "
              f"follows (a larger --iterations continues it)", file=sys.stderr, flush=True)
        print(json.dumps(summary, indent=2) if a.json else _format_summary(summary))
        return 0
    print(f"k3rl: {estimate_line(s)}", file=sys.stderr, flush=True)
    removed = resume.remove_dead_staging(s.pipeline.artifacts, run_id)
    if removed:
        print(f"k3rl: run '{run_id}': removed {len(removed)} staging path(s) of a killed process "
              f"({', '.join(p.name for p in removed[:3])}{', ...' if len(removed) > 3 else ''})", file=sys.stderr)
    if not checked:  # a run with a summary that continues (a larger --iterations)
        resume.check_prefect_environment()
    resume.start_embedded_server()
    tag = resume.run_tag(lock_file)
    crashed = resume.crash_stale_flow_runs(tag)
    if crashed:
        print(f"k3rl: run '{run_id}': marked {len(crashed)} flow run(s) of a killed process Crashed "
              f"({', '.join(crashed)})", file=sys.stderr)
    from prefect.exceptions import TerminationSignal

    from flows.signals import STOPS, resume_line, stop_guard

    try:
        bar = not a.no_progress and progress_wanted()
        with (stop_guard(run_id) as stopped, run_progress(bar), stage_heartbeat(not a.no_progress and not bar),
              tags(tag), _no_disk_full_tracebacks(not a.debug)):
            summary = rl_run(s)
    except (KeyboardInterrupt, TerminationSignal) as e:  # the flow runs are marked Crashed by now
        sig = getattr(e, "signal", None) or stopped.get("signal") or signal.SIGINT
        print(resume_line(run_id, sig), file=sys.stderr)
        return STOPS.get(sig, 130)
    except Exception as e:  # the failing stage has logged its traceback through Prefect
        from k3core.storage import StorageError

        full = disk_full_message(e, s.pipeline.artifacts)
        if full:
            if a.debug:
                traceback.print_exc()
            print(f"k3rl: error: run '{run_id}' stopped: {full}; no partial artifact was published and finished "
                  f"stages are kept: free space there and run the same command to resume", file=sys.stderr)
            return 1

        if isinstance(e, StorageError) and e.permanent:  # access, credentials, bucket: the user's to fix
            print(f"k3rl: error: run '{run_id}' stopped: {e}; no partial artifact was published and finished stages "
                  f"are kept: fix this and run the same command to resume", file=sys.stderr)
            return 2
        print(f"k3rl: run '{run_id}' failed: {type(e).__name__}: {e}\n"
              f"k3rl: finished stages are kept; fix the cause and run the same command to resume", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if a.json else _format_summary(summary))
    return 0


def disk_full_message(e: BaseException, artifacts: str) -> str | None:
    """What a full disk behind ``e`` says (the file being written, the free space now), None when
    no full disk is behind it."""
    from flows.preflight import _local_path
    from k3core.rl.disk import disk_full_error, existing_dir, free_bytes, gb

    err = disk_full_error(e)
    if err is None:
        return None
    where = err.filename or _local_path(artifacts) or artifacts
    what = f"{err.strerror or 'the disk is full'} writing {err.filename}" if err.filename else \
        f"{err.strerror or 'the disk is full'} under --artifacts {artifacts}"
    try:
        free = f"{gb(free_bytes(where))} free now on {existing_dir(where)}"
    except (OSError, TypeError):
        return f"the disk is full: {what}"
    return f"the disk is full: {what} ({free})"


@contextlib.contextmanager
def _no_disk_full_tracebacks(quiet: bool):
    """While the run runs, log lines of a full disk carry no traceback on the terminal (Prefect logs
    each failed stage's): the one error line says it all; ``--debug`` keeps them. Only the stream
    handlers print a copy without it; other handlers (Prefect's API: the UI) get the record whole."""
    import copy
    import logging

    from k3core.rl.disk import disk_full_error

    if not quiet:
        yield
        return
    handlers = {id(h): h for lg in [logging.root, *logging.root.manager.loggerDict.values()]
                if isinstance(lg, logging.Logger) for h in lg.handlers if isinstance(h, logging.StreamHandler)}

    def without_traceback(emit):
        def emit_record(record: logging.LogRecord) -> None:
            if record.exc_info and disk_full_error(record.exc_info[1]) is not None:
                record = copy.copy(record)
                record.exc_info, record.exc_text = None, None
            emit(record)
        return emit_record

    for h in handlers.values():
        h.emit = without_traceback(h.emit)
    try:
        yield
    finally:
        for h in handlers.values():
            del h.emit  # the class's own again


def _format_summary(s: dict) -> str:
    lines = [f"run {s['run_id']}: {s['iterations']} iterations of {s['env']} on '{s['preset']}' in {s['wall_seconds']:.0f} s",
             f"  held-out reward, sampled: {_f(s['heldout_reward_start'])} -> {_f(s['heldout_reward_end'])} "
             f"(solved {_f(s['heldout_solved_start'])} -> {_f(s['heldout_solved_end'])})",
             f"  held-out reward, greedy: {_f(s.get('heldout_greedy_reward_start'))} -> "
             f"{_f(s.get('heldout_greedy_reward_end'))}",
             f"  train reward (sampled): {_f(s['train_reward_first'])} -> {_f(s['train_reward_last'])}",
             "  seconds per stage: " + ", ".join(f"{k} {v}" for k, v in s["seconds_per_stage"].items())]
    mem = s.get("memory_per_stage") or {}
    if mem:
        peak = "device_peak_bytes" if s.get("device") == "cuda" else "host_rss_peak_bytes"
        lines.append(f"  peak {'device memory' if peak.startswith('device') else 'host RSS'} per stage (GiB): "
                     + ", ".join(f"{k} {v.get(peak, 0) / 2**30:.2f}" for k, v in mem.items()))
    return "\n".join(lines)


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def cmd_prepare(a) -> int:
    s = _settings_from_args(a)
    check_settings(s, prepare_only=True)
    from flows.pipeline import prepare

    if getattr(a, "run_id_generated", False):
        print(f"k3rl: preparing a new run '{s.pipeline.run_id}'; `k3rl run --run-id {s.pipeline.run_id} ...` runs it",
              file=sys.stderr, flush=True)

    try:
        out = prepare(s)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        full = disk_full_message(e, s.pipeline.artifacts)
        if full:
            print(f"k3rl: error: prepare of run '{s.pipeline.run_id}' stopped: {full}; free space there and run the "
                  "same command to resume", file=sys.stderr)
            return 1
        print(f"k3rl: prepare of run '{s.pipeline.run_id}' failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(out), indent=2, default=str))
    return 0


def cmd_model_info(a) -> int:
    from k3core.config import K3Config
    from k3core.model.info import format_model_info, model_info

    if a.config:
        try:
            cfg = K3Config.from_json_file(a.config)
        except FileNotFoundError:
            raise ValueError(f"--config {a.config}: no such file; give a checkpoint's config.json, or --preset") from None
        except (TypeError, KeyError, AttributeError) as e:  # a config.json of the wrong shape
            raise ValueError(f"--config {a.config} is not a K3 config.json ({type(e).__name__}: {e}); give a "
                             "checkpoint's config.json, or --preset") from None
    else:
        cfg = K3Config.preset(a.preset)
    info = model_info(cfg)
    print(json.dumps(info, indent=2) if a.json else format_model_info(a.config or a.preset, info))
    return 0


def cmd_status(a) -> int:
    from flows.status import format_status, run_status

    run_id = a.run_id
    if run_id is None:  # run ids are generated when not given: show the newest run
        from flows.status import newest_run

        run_id = newest_run(a.artifacts)
        print(f"k3rl: status of the newest run '{run_id}' under {a.artifacts} (--run-id ID for another)",
              file=sys.stderr)
    st = run_status(a.artifacts, run_id)  # RunNotFound is a ValueError: exit status 2
    print(json.dumps(st, indent=2) if a.json else format_status(st))
    return 0


# Examples shown under each subcommand's --help (subcommands registered elsewhere keep an epilog of
# their own when they have one).
EXAMPLES = {
    "run": """examples:
  k3rl run --preset small --iterations 30 --env reverse --run-id demo
  k3rl run --preset tiny --iterations 3 --run-id try --artifacts s3://bucket/k3rl      # any fsspec URL
  PYTHONPATH=~/envs k3rl run --env uppercase_env:make_env --run-id upper              # your environment
  k3rl run --run-id demo --iterations 40     # same run id: resumes, finished stages are skipped
  k3rl run --run-id demo --keep-checkpoints 2   # disk: only the newest 2 trainer states stay
  k3rl run --device cuda --preset medium --iterations 3 --run-id gpu   # every stage on the GPU
  PREFECT_API_URL=http://127.0.0.1:4200/api k3rl run ...   # report to a Prefect server (UI)""",
    "prepare": """examples:
  k3rl prepare --preset tiny --run-id try                      # fetch, validate, warm up, quantize
  k3rl prepare --preset small --source file:///data/k3-small --warmup-steps 0 --run-id from-disk""",
    "model-info": """examples:
  k3rl model-info --preset full
  k3rl model-info --config path/to/config.json --json""",
    "status": """examples:
  k3rl status                     # the newest run under ./artifacts
  k3rl status --run-id demo
  k3rl status --run-id demo --artifacts s3://bucket/k3rl --json | jq .heldout_reward.last""",
    "plan": """examples:
  k3rl plan --preset full --hardware b300 --tokens-per-gpu 100000
  k3rl plan --preset full --tp 8 --ep 64 --pp 8 --fsdp --json""",
    "checkpoint": """examples:
  k3rl checkpoint init --preset tiny --out ckpt/tiny
  k3rl checkpoint fetch file:///data/ckpt ckpt/copy --pin pin.json
  k3rl checkpoint validate ckpt/tiny --report report.json
  k3rl checkpoint quantize ckpt/tiny ckpt/tiny-mxfp4""",
    "quantize": "example:\n  k3rl checkpoint quantize ckpt/tiny ckpt/tiny-mxfp4",
    "rollout-server": """examples:
  k3rl rollout-server --checkpoint ckpt/tiny --port 30000
  k3rl rollout-server --checkpoint ckpt/tiny-mxfp4 --dtype bfloat16 --max-batch 64   # W4A8 experts""",
    "validate": """examples:
  k3rl checkpoint validate ckpt/tiny --roundtrip --write-pin tiny.pin.json
  k3rl checkpoint validate ckpt/copy --pin tiny.pin.json --json""",
}

MAIN_EPILOG = """start here:
  k3rl run --preset small --iterations 30 --run-id demo      a full RL run (Prefect embedded mode)
  k3rl status --run-id demo                                  what that run has done
  k3rl serve  (or: k3rl deploy; k3rl worker)                 the deployments of prefect.yaml, scheduled
  k3rl rollout-server --checkpoint DIR                       a checkpoint behind the SGLang-style HTTP API
  k3rl <command> --help                                      options and examples of one command
exit status: 0 ok, 1 the work failed, 2 bad usage or input, 130 interrupted"""


def _add_examples(sub) -> None:
    """Put EXAMPLES under the subcommands, and under checkpoint's subcommands, that show none yet
    (an epilog without examples, such as an exit-status note, keeps its text above them)."""
    def fill(name: str, p: argparse.ArgumentParser) -> None:
        p.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the examples' line breaks
        if name in EXAMPLES and "example" not in (p.epilog or ""):
            p.epilog = f"{p.epilog}\n\n{EXAMPLES[name]}" if p.epilog else EXAMPLES[name]

    for name, p in sub.choices.items():
        fill(name, p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child_name, child in action.choices.items():
                    fill(child_name, child)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3rl", description="RL post-training for Kimi-K3-architecture models",
                                epilog=MAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="print the traceback with an error (errors are one message "
                   "without one by default)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="a full RL run (prepare + iterations), Prefect embedded mode by default")
    _add_run_args(r)
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress display: neither the bar (drawn on stderr when it is a terminal) nor the "
                        "heartbeat lines naming a long stage in flight (written when stderr is a file or pipe)")
    r.set_defaults(fn=cmd_run)
    pr = sub.add_parser("prepare", help="fetch, validate, warm up and quantize (no RL iterations)")
    _add_run_args(pr)
    pr.set_defaults(fn=cmd_prepare)
    mi = sub.add_parser("model-info", help="parameter counts and bytes from the config (meta device)")
    mi.add_argument("--preset", default="full", help="tiny, small, medium or full (default full)")
    mi.add_argument("--config", default=None, help="a config.json instead of a preset")
    mi.add_argument("--json", action="store_true", help="print JSON instead of the table")
    mi.set_defaults(fn=cmd_model_info)
    st = sub.add_parser("status", help="summarise a run from its artifacts: iterations done, latest checkpoint, "
                        "reward trend", description="Summarise a run from its artifacts alone (no Prefect server "
                        "needed):\niterations done, latest checkpoint, held-out and train reward (first, last, "
                        "best).\nExit status 2 when the run does not exist.")
    st.add_argument("--run-id", dest="run_id", default=None, help="the run (default: the newest run under --artifacts)")
    st.add_argument("--artifacts", default="./artifacts", help="artifact root: a path or fsspec URL (default ./artifacts)")
    st.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    st.set_defaults(fn=cmd_status)
    from flows.cli_checkpoint import add_checkpoint_subcommands
    from flows.cli_plan import add_plan_subcommand
    from flows.cli_serve import add_rollout_server_subcommand, refuse_checkpoint_on_serve
    from flows.cli_sglang import add_sglang_server_subcommand
    from flows.cli_deploy import add_deploy_subcommands

    add_checkpoint_subcommands(sub)
    add_deploy_subcommands(sub)
    refuse_checkpoint_on_serve(sub)  # `serve` is the deployments; the rollout server has its own name
    add_plan_subcommand(sub)
    add_rollout_server_subcommand(sub)
    add_sglang_server_subcommand(sub)
    _add_examples(sub)
    return p


_EXIT_CODE: list[int] = []  # main's status once it has returned, for _exit_without_teardown


def _exit_without_teardown() -> None:
    """The last exit handler (registered first): once ``main`` has returned and every other exit
    handler has run (Prefect's services drained, the embedded server stopped, temporary folders
    removed), end the process without the interpreter's teardown of its modules and objects. A
    ``k3rl run`` spent about 1.5 s of CPU and 1-5 s of wall time there (torch, Prefect, the model's
    objects), every artifact being closed and published already (docs/results/test_suite.md).
    Where ``main`` did not return (an uncaught exception), the normal teardown runs. A handler
    registered before ``entry`` would be skipped: importing this module registers none."""
    if not _EXIT_CODE:
        return
    import logging
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_EXIT_CODE[0])


def entry() -> int:
    """The ``k3rl`` program (its console script, ``python -m flows.cli``): ``main`` in a process of
    its own, which it ends without the interpreter's teardown. Callers of ``main`` in a process that
    goes on (tests, notebooks) keep their own exit."""
    import atexit

    atexit.register(_exit_without_teardown)  # first registered, so the last to run
    code = main()
    _EXIT_CODE.append(code)
    return code


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    argv = list(given)
    if "--debug" in argv[1:]:  # also accepted after the subcommand, where people type it
        argv.remove("--debug")
        argv.insert(0, "--debug")
    from k3core.storage import StorageError

    args = build_parser().parse_args(argv)
    args.argv = given  # as typed: the resume command repeats it
    handler = getattr(args, "fn", None) or args.func
    try:
        return handler(args) or 0
    except StorageError as e:  # reading or writing an artifact root (``status``, ...): named, with the fix
        print(f"k3rl: error: {e}", file=sys.stderr)
        return 2 if e.permanent else 1
    except (ValueError, FileNotFoundError, NotImplementedError) as e:  # bad input, found before the work
        if args.debug:
            traceback.print_exc()
        print(f"k3rl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("k3rl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # not bad input: the work failed; the traceback is for whoever debugs it
        if args.debug:
            traceback.print_exc()
        full = disk_full_message(e, getattr(args, "artifacts", None) or ".")
        if full:
            print(f"k3rl: error: {full}; free space there and run the command again", file=sys.stderr)
            return 1
        print(f"k3rl: error: {type(e).__name__}: {e}\nk3rl: the command failed; `k3rl --debug {args.cmd} ...` "
              "prints the traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(entry())
