"""End to end against a real ``prefect server start`` on 127.0.0.1 (started and stopped here, with its
own PREFECT_HOME): ``k3rl serve`` serves the deployments of a copy of prefect.yaml (tiny settings,
artifacts in tmp), ``run_deployment`` runs ``rl_run`` to Completed, ``rl_continue`` skips a run whose
lock is held (Skipped, nothing run, one warning) and adds one iteration to a run when it is free; of two ticks at
once the server cancels the second before it starts (no traceback); the scheduled deployment
gets auto-scheduled runs carrying the schedule's run id. (Ticks racing each other: test_deploy_lock.py.)"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, UTC
from pathlib import Path

import pytest
import yaml

from flows.deploy import DEFAULT_FILE, PROJECT_ROOT, run_lock

TINY = {"model": {"preset": "tiny", "source": "init:tiny:0"}, "pipeline": {"env": "add", "iterations": 1},
        "rollout": {"prompts_per_iteration": 2, "samples_per_prompt": 2, "max_new_tokens": 3},
        "warmup": {"steps": 1, "batch": 4}, "evaluation": {"prompts": 4, "every": 1}}


def _tiny(**pipeline) -> dict:
    """The tiny settings (the deployments' parameter, by section) with pipeline settings added."""
    return {**TINY, "pipeline": {**TINY["pipeline"], **pipeline}}


def _local_server_helpers():
    """free_port, wait_healthy and stop of ``tests/prefect_local.py`` (one copy of that logic)."""
    spec = importlib.util.spec_from_file_location("_k3rl_test_prefect_local", Path(__file__).parents[1] / "prefect_local.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_h = _local_server_helpers()
_free_port, _wait_healthy, _stop = _h.free_port, _h.wait_healthy, _h.stop


def _test_yaml(tmp_path: Path, artifacts: str) -> Path:
    cfg = yaml.safe_load(DEFAULT_FILE.read_text())
    for d in cfg["deployments"]:
        d["entrypoint"] = str(PROJECT_ROOT / d["entrypoint"])
        d["parameters"]["settings"] = _tiny(artifacts=artifacts, run_id="yaml-default")
        if "artifacts" in d["parameters"]:
            d["parameters"]["artifacts"] = artifacts
        for s in d.get("schedules") or []:
            # runs exist at once but none is due during the test
            s.update(interval=86400, anchor_date=(datetime.now(UTC) + timedelta(hours=2)).isoformat())
            s["parameters"] = {"run_id": "scheduled-run"}
    out = tmp_path / "prefect-test.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_served_deployments_run_continue_and_schedule(tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    artifacts = str(tmp_path / "artifacts")
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", PREFECT_RUNNER_POLL_FREQUENCY="1",
               PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
               PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS="1",
               PREFECT_UI_ENABLED="false", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    server = runner = None
    logs = tmp_path / "logs"
    logs.mkdir()
    t0 = time.monotonic()
    try:
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, cwd=tmp_path, start_new_session=True,
                                  stdout=open(logs / "server.log", "w"), stderr=subprocess.STDOUT)
        _wait_healthy(api, server, timeout=300)
        print(f"server healthy: {time.monotonic() - t0:.0f} s")
        runner = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--file",
                                   str(_test_yaml(tmp_path, artifacts))], env=env, cwd=PROJECT_ROOT,
                                  start_new_session=True, stdout=open(logs / "serve.log", "w"),
                                  stderr=subprocess.STDOUT)
        _drive(api, env, artifacts, runner, logs)
    finally:
        t1 = time.monotonic()
        _stop(runner, grace=0)  # nothing to keep: its graceful exit only pauses schedules in a throw-away server
        _stop(server, grace=15)
        print(f"stopped in {time.monotonic() - t1:.0f} s")


def _drive(api: str, env: dict, artifacts: str, runner: subprocess.Popen, logs: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.deployments import run_deployment
    from prefect.settings import temporary_settings, PREFECT_API_URL, PREFECT_HOME

    T0 = time.monotonic()
    with temporary_settings(updates={PREFECT_API_URL: api, PREFECT_HOME: env["PREFECT_HOME"]}):
        with get_client(sync_client=True) as client:
            end = time.monotonic() + 300
            while True:  # the runner registers the deployments once it has imported the flows
                assert runner.poll() is None, (logs / "serve.log").read_text()[-3000:]
                try:
                    cont = client.read_deployment_by_name("rl_continue/rl-continue")
                    client.read_deployment_by_name("rl_run/rl-run")
                    break
                except Exception:
                    assert time.monotonic() < end, "deployments not registered"
                    time.sleep(1)

            def run(name, params):
                fr = run_deployment(name, parameters=params, timeout=600, poll_interval=1)
                return fr.state

            def latest(run_id):
                return json.loads((Path(artifacts) / "runs" / run_id / "latest.json").read_text())["iteration"]

            print(f"deployments registered: {time.monotonic() - T0:.0f} s")
            fr = run_deployment("rl_run/rl-run", parameters={"settings": _tiny(artifacts=artifacts, run_id="r1")},
                                timeout=0)
            # meanwhile, a tick of a run that another tick holds: skipped, nothing done
            log_before = len((logs / "serve.log").read_text())
            with run_lock(artifacts, "busy") as held:
                assert held
                st = run("rl_continue/rl-continue", {"run_id": "busy", "artifacts": artifacts, "settings": _tiny()})
            assert st.is_completed() and st.name == "Skipped", st
            assert "busy" in (st.message or "")
            skip_log = (logs / "serve.log").read_text()[log_before:]
            assert "skipping this tick" in skip_log and "Traceback" not in skip_log, skip_log[-3000:]
            assert not (Path(artifacts) / "runs" / "busy" / "settings.json").exists()  # it stopped before anything
            end = time.monotonic() + 600
            while not (st := client.read_flow_run(fr.id).state).is_final():
                assert time.monotonic() < end, st
                time.sleep(1)
            assert st.is_completed(), (st, (logs / "serve.log").read_text()[-3000:])
            assert latest("r1") == 1
            print(f"rl_run and skipped tick done: {time.monotonic() - T0:.0f} s")

            # a bad parameter fails the run before any stage runs, with the CLI's message, and writes nothing
            bad = _tiny(artifacts=artifacts, run_id="bad")
            bad["rollout"] = {**bad["rollout"], "temperature": -1.0, "top_p": 3.0}
            st = run("rl_run/rl-run", {"settings": bad})
            assert st.is_failed(), st
            for problem in ("--temperature must be >= 0.0, got -1.0", "--top-p must lie in (0, 1], got 3.0"):
                assert problem in (st.message or ""), st.message
            assert not (Path(artifacts) / "runs" / "bad").exists()
            failed = client.read_flow_runs(limit=50)
            bad_run = next(r for r in failed if r.state and r.state.is_failed() and r.parameters["settings"] == bad)
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

            assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[bad_run.id]))) == []
            # an unknown setting is refused by the server's parameter schema before a run is even created
            with pytest.raises(Exception, match="tempreature"):
                run_deployment("rl_run/rl-run", parameters={"settings": {"rollout": {"tempreature": 0.5}}}, timeout=0)
            print(f"bad parameters refused: {time.monotonic() - T0:.0f} s")

            cont_params = {"run_id": "r1", "artifacts": artifacts, "settings": _tiny()}
            st = run("rl_continue/rl-continue", cont_params)  # the lock is free: one more iteration
            assert st.is_completed(), st
            assert latest("r1") == 2

            # two ticks at once (a tick still running when the next is due): the deployment's
            # concurrency limit (CANCEL_NEW, prefect.yaml) cancels the second before it starts, with
            # one line in the runner's log and no traceback; the first adds its one iteration
            log_before = len((logs / "serve.log").read_text())
            pair = [run_deployment("rl_continue/rl-continue", parameters=cont_params, timeout=0) for _ in range(2)]
            end = time.monotonic() + 600
            while not all((st := client.read_flow_run(f.id).state).is_final() for f in pair):
                assert time.monotonic() < end, st
                time.sleep(1)
            states = [client.read_flow_run(f.id).state for f in pair]
            assert sorted(st.type.value for st in states) == ["CANCELLED", "COMPLETED"], states
            cancelled = next(st for st in states if st.is_cancelled())
            assert "concurrency limit" in (cancelled.message or ""), cancelled
            assert latest("r1") == 3
            tick_log = (logs / "serve.log").read_text()[log_before:]
            assert "Traceback" not in tick_log and "| ERROR" not in tick_log, tick_log[-3000:]
            print(f"overlapping ticks: {time.monotonic() - T0:.0f} s")

            # the schedule: auto-scheduled runs of rl_continue that carry the schedule's run id
            end = time.monotonic() + 120
            while True:
                runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[cont.id])),
                                             flow_run_filter=None, limit=20)
                sched = [r for r in runs if r.auto_scheduled]
                if sched:
                    break
                assert time.monotonic() < end, "no auto-scheduled run for rl-continue"
                time.sleep(1)
            assert all(r.parameters.get("run_id") == "scheduled-run" for r in sched)
            assert all(r.state.is_scheduled() for r in sched)
            print(f"scheduled runs seen: {time.monotonic() - T0:.0f} s")
