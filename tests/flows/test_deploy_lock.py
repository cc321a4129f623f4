"""rl_continue's run lock (no two ticks of one run at once, across threads and processes; a dead
holder frees it, and the next holder knows it took over from that pid), settings precedence for continued runs, and prefect.yaml: every deployment loads,
its parameters validate against its flow, and the scheduled deployment names the run it continues.
No Prefect server needed (the end-to-end test is tests/flows/test_deployments.py)."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from flows.deploy import (DEFAULT_FILE, iterations_done, load_config, lock_path, resolve_settings, run_lock,
                          runner_deployments)
from flows.pipeline import RLSettings


def test_lock_excludes_a_second_holder_in_the_same_process(tmp_path):
    root = str(tmp_path)
    with run_lock(root, "r") as first:
        assert first
        with run_lock(root, "r") as second:  # a second open file: flock conflicts even in one process
            assert not second
        with run_lock(root, "other-run") as other:  # locks are per run
            assert other
    with run_lock(root, "r") as again:
        assert again
    assert lock_path(root, "r") == tmp_path / "runs" / "r" / ".lock"


def test_lock_held_by_another_process_and_freed_when_it_dies(tmp_path):
    holder = textwrap.dedent(f"""
        import sys, time
        from flows.runlock import run_lock
        with run_lock({str(tmp_path)!r}, "r") as held:
            print("held" if held else "busy", flush=True)
            time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with run_lock(str(tmp_path), "r") as got:
            assert not got and got.holder == p.pid  # the busy lock names its holder
        p.kill()  # a crashed holder (SIGKILL): the kernel drops its lock
        p.wait(timeout=60)
        with run_lock(str(tmp_path), "r") as got:
            assert got and got.took_over_from == p.pid  # taken over, and the dead holder is known
        with run_lock(str(tmp_path), "r") as got:  # the last holder released it cleanly: no takeover
            assert got and got.took_over_from is None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=60)


def test_racing_processes_never_hold_the_run_at_once(tmp_path):
    """Three processes tick the same run 20 times each; every holder logs start/end around its
    'iteration': the log must never show two holders inside at once (starts and ends pair up)."""
    log = tmp_path / "log"
    ticker = textwrap.dedent(f"""
        import os, time
        from flows.runlock import run_lock
        for _ in range(20):
            with run_lock({str(tmp_path)!r}, "r") as held:
                if held:
                    with open({str(log)!r}, "a") as f:
                        f.write(f"start {{os.getpid()}}\\n"); f.flush()
                        time.sleep(0.01)
                        f.write(f"end {{os.getpid()}}\\n")
            time.sleep(0.001)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", ticker]) for _ in range(3)]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = log.read_text().split()
    events = list(zip(lines[0::2], lines[1::2]))
    assert events, "no tick ever held the lock"
    for (k1, pid1), (k2, pid2) in zip(events[0::2], events[1::2]):
        assert (k1, k2) == ("start", "end") and pid1 == pid2, "two ticks held the run at once"
    assert len(events) % 2 == 0


def test_continued_run_keeps_its_recorded_settings(tmp_path):
    root = str(tmp_path)
    assert iterations_done(root, "r") == 0
    first = RLSettings.from_dict(dict(preset="tiny", source="init:tiny:0", prompts_per_iteration=2))
    s, warn = resolve_settings("r", root, first)
    assert (s.model.preset, s.rollout.prompts_per_iteration, s.pipeline.run_id, s.pipeline.artifacts) == (
        "tiny", 2, "r", root)
    assert warn == []
    recorded = json.loads((tmp_path / "runs" / "r" / "settings.json").read_text())
    assert recorded["rollout"]["prompts_per_iteration"] == 2
    # a later tick with other settings continues with the recorded ones and says so
    s2, warn2 = resolve_settings("r", root, first.replace(prompts_per_iteration=8, iterations=99))
    assert s2.rollout.prompts_per_iteration == 2
    assert len(warn2) == 1 and "rollout.prompts_per_iteration=8" in warn2[0] and "iterations" not in warn2[0]
    (tmp_path / "runs" / "r" / "latest.json").write_text(json.dumps({"run_id": "r", "iteration": 3}))
    assert iterations_done(root, "r") == 3


def test_prefect_yaml_deployments_load_and_validate():
    cfg = load_config(DEFAULT_FILE)
    by_name = {d["name"]: d for d in cfg["deployments"]}
    assert set(by_name) == {"prepare", "rl-run", "rl-continue"}
    deps = {d.name: d for d in runner_deployments(DEFAULT_FILE)}
    assert {d.flow_name for d in deps.values()} == {"prepare", "rl_run", "rl_continue"}
    from prefect.flows import load_flow_from_entrypoint

    for d in by_name.values():
        fl = load_flow_from_entrypoint(str(DEFAULT_FILE.parent / d["entrypoint"]))
        params = fl.validate_parameters(d["parameters"])  # pydantic coerces the settings dict
        settings = params["settings"]
        # (a flow loaded from its file has its own copy of the RLSettings class)
        assert dataclasses.is_dataclass(settings) and type(settings).__name__ == "RLSettings"
        # the README's demo, which learns: small preset, reverse environment, 30 iterations
        assert (settings.model.preset, settings.pipeline.env, settings.pipeline.iterations) == ("small", "reverse", 30)
        assert d["work_pool"]["name"] == "k3rl-local"
    cont = by_name["rl-continue"]
    assert cont["schedules"] and all("run_id" in s["parameters"] for s in cont["schedules"])
    sched = deps["rl-continue"].schedules
    assert len(sched) == 1 and sched[0].parameters == {"run_id": "demo"}
    assert not deps["rl-run"].schedules and not deps["prepare"].schedules
    # overlapping ticks are cancelled by the server before they start (no traceback in the runner)
    assert deps["rl-continue"].concurrency_limit == 1
    assert deps["rl-continue"].concurrency_options.collision_strategy.value == "CANCEL_NEW"
    assert deps["rl-run"].concurrency_limit is None


def test_cli_has_deploy_worker_serve():
    from flows.cli import build_parser

    p = build_parser()
    assert p.parse_args(["deploy", "--name", "rl-run"]).fn.__name__ == "cmd_deploy"
    a = p.parse_args(["worker", "--pool", "p1"])
    assert a.pool == "p1" and a.fn.__name__ == "cmd_worker"
    assert p.parse_args(["serve", "--name", "rl-run"]).name == ["rl-run"]


def test_deploy_without_server_says_how_to_start_one(monkeypatch, capsys):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.cli import main

    with temporary_settings(restore_defaults={PREFECT_API_URL}):  # even inside a session's test harness
        assert main(["deploy"]) == 2
    assert "prefect server start" in capsys.readouterr().err


def test_serve_overrides_the_preset_and_the_interval_without_editing_the_file():
    deps = {d.name: d for d in runner_deployments(DEFAULT_FILE, preset="tiny", interval=60)}
    for name in ("prepare", "rl-run", "rl-continue"):
        model = deps[name].parameters["settings"]["model"]
        assert model == {"preset": "tiny", "source": "init:tiny:0"}, model
    (sched,) = deps["rl-continue"].schedules
    assert sched.schedule.interval.total_seconds() == 60 and sched.parameters == {"run_id": "demo"}
    # the file itself is what it was
    assert {d.name: d for d in runner_deployments(DEFAULT_FILE)}["rl-run"].parameters["settings"]["model"]["preset"] == "small"
    with pytest.raises(ValueError, match="--interval 0"):
        runner_deployments(DEFAULT_FILE, interval=0)
