"""Scale-out end to end on the tiny preset, Prefect in embedded mode, real Dask and real Ray:

- a LocalCluster run (2 resident engine workers): the same rollout rows, iteration by iteration, as
  the one-process run (the reference), the same scored rows (the environment is sandboxed, so its
  reward calls fan out over the workers too), and the same final weights up to rounding;
- a run that joins a Dask cluster started as separate processes (``dask scheduler``, 2 ``dask
  worker``), one of whose workers is killed with SIGKILL while it runs a rollout shard: the run
  completes and its rows equal the reference's;
- a local Ray run (2 engine actors), one of whose actor processes is killed with SIGKILL while it
  generates a shard: the run completes and its rows equal the reference's;
- a run that joins a Ray cluster started as separate processes (``ray start --head``): the
  reference's rows, both actors serving every iteration;
- bad scale-out usage exits 2 with the fix named, before any work.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("prefect_dask", reason="scale-out tests need the test extra (prefect-dask, distributed)")

from flows.pipeline import RLSettings, rl_run  # noqa: E402
from k3core.rl import engines, trainers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# the even-bytes environment of tests/even_bytes_env.py (crash injection included), under this test file's
# own module name
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()
ITERATIONS = 2
DASK_CONFIG = "distributed:\n  nanny:\n    pre-spawn-environ:\n      MALLOC_TRIM_THRESHOLD_: null\n"


def _settings(root: Path, run_id: str, **kw) -> RLSettings:
    base = dict(preset="tiny", source="init:tiny:3", env="scale_env_for_tests:make", iterations=ITERATIONS,
                artifacts=str(root), run_id=run_id, prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=4,
                warmup_steps=1, warmup_batch=8, eval_prompts=4, eval_every=0, mismatch_sequences=0, lr=1e-3)
    base.update(kw)
    return RLSettings.from_dict(base)


@pytest.fixture(scope="module")
def env_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("env")
    (d / "scale_env_for_tests.py").write_text(ENV_SRC)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


@pytest.fixture(scope="module")
def reference(env_module, tmp_path_factory, prefect_harness):
    """The one-process run (local task runner, one train process)."""
    root = tmp_path_factory.mktemp("local")
    engines.clear()
    trainers.clear()
    summary = rl_run(_settings(root, "ref"))
    assert summary["iterations"] == ITERATIONS
    return root / "runs" / "ref"


def _same_rows(run: Path, ref: Path) -> list[set[str]]:
    """Every iteration's rollout table equals the reference's row for row: prompts, token ids,
    routing, versions exactly; log-probabilities to rounding. Batch composition changes the last
    bits of iteration 0's log-probabilities (k3core.rl.shards says why); those feed the update
    through the importance weights, and re-quantising the updated experts to MXFP4 can move a
    weight next to a code boundary into the neighbouring code, so later iterations' log-probabilities
    agree to 1e-3 rather than 1e-5. The scored tables' rewards, advantages and reasons are equal
    exactly, and came from reward shards (the fan-out), which the reference has none of.
    -> the workers of each iteration."""
    workers = []
    for it in range(ITERATIONS):
        atol = 1e-5 if it == 0 else 1e-3
        got, want = (pq.read_table(p / f"iter-{it:04d}" / "rollouts.parquet") for p in (run, ref))
        assert got.schema.equals(want.schema) and got.num_rows == want.num_rows == 16
        for col in want.column_names:
            if col == "logprobs":
                for a, b in zip(got.column(col).to_pylist(), want.column(col).to_pylist()):
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)
            elif col != "worker":
                assert got.column(col).to_pylist() == want.column(col).to_pylist(), (it, col)
        assert set(want.column("worker").to_pylist()) == {"local"}
        workers.append(set(got.column("worker").to_pylist()))
        got, want = (pq.read_table(p / f"iter-{it:04d}" / "scored.parquet") for p in (run, ref))
        for col in ("prompt_index", "sample_index", "reward", "advantage", "reward_reason"):
            assert got.column(col).to_pylist() == want.column(col).to_pylist(), (it, col)
        assert len(list((run / f"iter-{it:04d}" / "score-shards").glob("shard-*-of-2.parquet"))) == 2
        assert not (ref / f"iter-{it:04d}" / "score-shards").exists()
    return workers


def _final_state(run: Path):
    from k3core.rl.trainer_state import load_trainer_state

    latest = json.loads((run / "latest.json").read_text())
    path = Path(latest["checkpoint"].removeprefix("file://")) / "state"
    model, _, extra = load_trainer_state(path, lr=0.0)
    return model.state_dict(), extra


@pytest.mark.slow  # two tiny RL runs in embedded Prefect plus a LocalCluster: ~1.5 min on 2 cores
def test_local_cluster_run_gives_the_one_process_run(reference, tmp_path):
    engines.clear()
    trainers.clear()
    s = _settings(tmp_path, "dask", task_runner="dask", rollout_workers=2)
    summary = rl_run(s)
    assert summary["iterations"] == ITERATIONS
    run = tmp_path / "runs" / "dask"
    assert _same_rows(run, reference) == [{"0", "1"}] * ITERATIONS  # both workers served every iteration

    got, extra = _final_state(run)
    want, ref_extra = _final_state(reference)
    assert extra["metrics"]["loss"] == pytest.approx(ref_extra["metrics"]["loss"], rel=1e-3, abs=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=5e-5, msg=k)


@pytest.mark.slow  # two tiny RL runs in embedded Prefect plus a LocalCluster: ~1 min on 2 cores
def test_staleness_one_on_a_local_cluster_gives_the_one_process_run(env_module, tmp_path, prefect_harness):
    """``--max-staleness 1`` with rollout shards on the workers: iteration 0 submits batch 1 to the
    workers' engines at version 0 and trains beside it, and the run equals the one-process run of the
    same settings (row for row, and in its final weights)."""
    engines.clear()
    trainers.clear()
    assert rl_run(_settings(tmp_path / "local", "ref1", max_staleness=1))["iterations"] == ITERATIONS
    ref = tmp_path / "local" / "runs" / "ref1"
    engines.clear()
    trainers.clear()
    assert rl_run(_settings(tmp_path, "dask1", task_runner="dask", rollout_workers=2,
                            max_staleness=1))["iterations"] == ITERATIONS
    run = tmp_path / "runs" / "dask1"
    assert _same_rows(run, ref) == [{"0", "1"}] * ITERATIONS
    # batch 1 was sampled by version 0, ahead, on the workers
    assert set(pq.read_table(run / "iter-0001" / "rollouts.parquet").column("weight_version").to_pylist()) == {0}
    metrics = json.loads((run / "metrics.json").read_text())
    assert [m["staleness"] for m in metrics] == [0, 1] and metrics[0]["buffer_depth"] == 1
    assert metrics[0]["seconds_rollout_ahead"] > 0 and "seconds_rollout_wait" in metrics[0]
    got, extra = _final_state(run)
    want, ref_extra = _final_state(ref)
    assert extra["metrics"]["loss"] == pytest.approx(ref_extra["metrics"]["loss"], rel=1e-3, abs=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=5e-5, msg=k)


@pytest.mark.slow  # three tiny Dask runs of three iterations: ~1.5 min on 2 cores
def test_a_crash_with_a_batch_sampled_ahead_on_the_workers_resumes_on_that_batch(env_module, tmp_path, monkeypatch,
                                                                                  prefect_harness):
    """``--max-staleness 1`` on two Dask workers: the scorer crashes in iteration 2, whose batch the
    workers sampled by version 1 during iteration 1 (published, not trained). The same run again
    scores and trains that batch without sampling it again (no shard or table rewritten) and ends
    bit-identical to an uninterrupted run."""
    import k3core.rl.train as train

    marker = tmp_path / "crash-now"
    monkeypatch.setenv("K3RL_TEST_CRASH_FILE", str(marker))  # before the cluster starts: its workers inherit it
    calls = [0]
    real_train = train.train_on_table

    def train_then_arm(*a, **k):  # iteration 1's train step arms the crash: the next scorer (iteration 2's) raises
        calls[0] += 1
        if calls[0] == arm_at[0]:
            marker.write_text("crash")
        return real_train(*a, **k)

    arm_at = [0]
    monkeypatch.setattr(train, "train_on_table", train_then_arm)
    kw = dict(task_runner="dask", rollout_workers=2, max_staleness=1, iterations=3)

    def fresh_run(root: Path, run_id: str):
        engines.clear()
        trainers.clear()
        return rl_run(_settings(root, run_id, **kw))

    fresh_run(tmp_path / "a", "a")
    arm_at[0], calls[0] = 2, 0
    with pytest.raises(Exception, match="injected scorer crash"):
        fresh_run(tmp_path / "b", "b")
    run = tmp_path / "b" / "runs" / "b"
    ahead = [run / "iter-0002" / "rollouts.parquet", *sorted((run / "iter-0002").rglob("shard-*.parquet"))]
    assert len(ahead) > 2 and not (run / "iter-0002" / "scored.parquet").exists()
    assert set(pq.read_table(ahead[0]).column("weight_version").to_pylist()) == {1}
    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in ahead}

    marker.unlink()
    fresh_run(tmp_path / "b", "b")
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in ahead} == stamps, "the batch ahead was sampled again"
    a, b = tmp_path / "a" / "runs" / "a", run
    for n in range(3):
        for t in ("rollouts.parquet", "scored.parquet"):
            want, got = (_without_workers(pq.read_table(r / f"iter-{n:04d}" / t)) for r in (a, b))
            assert got.equals(want), (n, t)
    got, _ = _final_state(b)
    want, _ = _final_state(a)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _without_workers(table):
    """``table`` without its ``worker`` column, where it has one (which worker served a shard is up to
    the scheduler)."""
    return table.drop_columns([c for c in ("worker",) if c in table.column_names])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a Dask cluster of 3 processes and a tiny RL run: ~1 min on 2 cores
def test_run_joins_a_separate_dask_cluster_and_survives_a_killed_worker(reference, env_module, tmp_path):
    from distributed import Client
    from prefect.settings import PREFECT_API_URL

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    (tmp_path / "dask-config").mkdir()  # the worker setting docs/scale-out.md gives (glibc's malloc left alone)
    (tmp_path / "dask-config" / "k3rl.yaml").write_text(DASK_CONFIG)
    # the workers import the checkout and the run's environment (its reward calls fan out to them)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(env_module), os.environ.get("PYTHONPATH", "")]),
               PREFECT_API_URL=PREFECT_API_URL.value(), OMP_NUM_THREADS="1", DASK_CONFIG=str(tmp_path / "dask-config"))
    logs = open(tmp_path / "cluster.log", "w")
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", str(port), "--no-dashboard"], env=env, stdout=logs, stderr=logs)]
    try:
        for k in range(2):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads",
                                           "1", "--nworkers", "1", "--no-dashboard", "--host", "127.0.0.1", "--name",
                                           f"ext{k}"], env=env, stdout=logs, stderr=logs))
        with Client(address, timeout=120) as client:
            client.wait_for_workers(2, timeout=120)
            assert set(client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()) == {None}
            engines.clear()
            trainers.clear()
            out: dict = {}

            def run():
                try:
                    out["summary"] = rl_run(_settings(tmp_path, "ext", task_runner="dask", dask_address=address,
                                                      rollout_workers=2))
                except BaseException as e:  # reported below
                    out["error"] = e

            flow = threading.Thread(target=run)
            flow.start()
            killed = None
            deadline = time.monotonic() + 300
            while killed is None and flow.is_alive() and time.monotonic() < deadline:
                busy = [w for w, keys in client.processing().items() if keys]  # only rollout shards are submitted
                if busy:
                    pid = client.run(os.getpid, workers=[busy[0]])[busy[0]]
                    os.kill(pid, signal.SIGKILL)
                    killed = busy[0]
                time.sleep(0.02)
            flow.join(timeout=600)
            assert not flow.is_alive(), "the run did not finish after its worker was killed"
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        logs.close()
    assert killed is not None, "no rollout shard was seen running, so no worker was killed"
    assert "was killed by signal 9" in (tmp_path / "cluster.log").read_text()  # the nanny saw its worker die
    assert "error" not in out, out.get("error")
    assert out["summary"]["iterations"] == ITERATIONS
    workers = _same_rows(tmp_path / "runs" / "ext", reference)
    assert set().union(*workers) <= {"ext0", "ext1"}


@pytest.mark.slow  # a local Ray instance and a tiny RL run: ~1 min on 2 cores
def test_local_ray_run_survives_a_killed_engine_actor(reference, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray", reason="the Ray run needs the test extra (ray, prefect-ray)")
    from ray._private import auto_init_hook

    from k3core.rl.resident import RAY_NAMESPACE, actor_name

    # this thread only looks at the Ray instance the run starts; a Ray call before that must not start one
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", False)
    engines.clear()
    trainers.clear()
    out: dict = {}

    def run():
        try:
            out["summary"] = rl_run(_settings(tmp_path, "ray", task_runner="ray", rollout_workers=2))
        except BaseException as e:  # reported below
            out["error"] = e

    flow = threading.Thread(target=run)
    flow.start()
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and flow.is_alive() and time.monotonic() < deadline:
        for k in range(2):
            if not ray.is_initialized():
                break
            try:  # the actors exist once the run has initialised Ray in this process and started them
                actor = ray.get_actor(actor_name("ray", k), namespace=RAY_NAMESPACE)
                status = ray.get(actor.status.remote(), timeout=5)
            except Exception:
                continue
            if status["busy"]:
                os.kill(status["pid"], signal.SIGKILL)
                killed = status["worker"]
                break
        time.sleep(0.02)
    flow.join(timeout=600)
    assert not flow.is_alive(), "the run did not finish after its engine actor was killed"
    assert killed is not None, "no engine actor was seen generating a shard, so none was killed"
    assert "error" not in out, out.get("error")
    assert out["summary"]["iterations"] == ITERATIONS
    assert not ray.is_initialized()  # the run shut down the Ray instance it started
    workers = _same_rows(tmp_path / "runs" / "ray", reference)
    assert set().union(*workers) <= {"ray-0", "ray-1"}


@pytest.mark.slow  # a Ray head of its own processes and a tiny RL run (`k3rl run` in a process): ~1.5 min on 2 cores
def test_k3rl_run_joins_a_separate_ray_cluster(reference, env_module, tmp_path):
    """``k3rl run --task-runner ray --ray-address`` in a process of its own, as a user runs it. (In one
    Python process, Ray 2.60 fails to create actors on a cluster joined after a local instance was
    started and shut down, so this test does not call ``rl_run`` in the test's process, which has.)"""
    pytest.importorskip("ray", reason="the Ray run needs the test extra (ray, prefect-ray)")
    from prefect.settings import PREFECT_API_URL

    port = _free_port()
    # the head's workers import the checkout and the run's environment; token authentication (Ray's
    # default for `ray start`) is off here so the run needs no token: docs/scale-out.md says how to join with one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(env_module), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", PREFECT_API_URL=PREFECT_API_URL.value())
    logs = open(tmp_path / "head.log", "w")
    # a temp dir of its own (short: Ray's socket paths must fit 107 bytes), so that the address file the
    # killed head leaves behind is not /tmp/ray's, which a later `ray.init()` on this machine would read
    ray_tmp = tempfile.mkdtemp(prefix="k3rl-ray-")
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port", str(port),
                             "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir",
                             ray_tmp, "--block"], env=env, stdout=logs, stderr=logs, start_new_session=True)
    flags = dict(preset="tiny", source="init:tiny:3", env="scale_env_for_tests:make", iterations=ITERATIONS,
                 artifacts=tmp_path, run_id="rayext", prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=4,
                 warmup_steps=1, warmup_batch=8, eval_prompts=4, eval_every=0, mismatch_sequences=0, lr=1e-3,
                 task_runner="ray", ray_address=f"127.0.0.1:{port}", rollout_workers=2)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        cli = subprocess.run([sys.executable, "-m", "flows.cli", "run",
                              *(x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v)))],
                             env=env, capture_output=True, text=True, timeout=600)
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the head and every process it started (one session)
        head.wait(timeout=30)
        logs.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert _same_rows(tmp_path / "runs" / "rayext", reference) == [{"ray-0", "ray-1"}] * ITERATIONS


@pytest.mark.parametrize("flags,message", [
    (["--rollout-workers", "2"], "--rollout-workers 2 needs --task-runner dask or ray"),
    (["--task-runner", "spark"], "--task-runner: unknown runner 'spark'; choose one of local, dask, ray"),
    (["--ray-address", "127.0.0.1:1"], "--ray-address needs --task-runner ray"),
    (["--task-runner", "ray", "--ray-address", "tcp://127.0.0.1:1"], "use HOST:PORT of the head node"),
    (["--task-runner", "ray", "--ray-address", "127.0.0.1:1"], "no Ray head answers there"),
    (["--task-runner", "ray", "--max-staleness", "1", "--in-flight", "continue"], "use --in-flight drain there"),
    (["--task-runner", "dask", "--dask-address", "127.0.0.1:1"], "use a scheduler address such as tcp://"),
    (["--task-runner", "dask", "--dask-address", "tcp://127.0.0.1:1"], "no Dask scheduler answers there"),
    (["--train-procs", "0"], "--train-procs must be >= 1"),
    (["--task-runner", "dask", "--rollout-url", "http://127.0.0.1:30000"], "cannot be combined with --rollout-url"),
])
def test_bad_scale_out_usage_exits_2_naming_the_fix(tmp_path, capsys, flags, message):
    from flows.cli import main

    code = main(["run", "--preset", "tiny", "--artifacts", str(tmp_path), "--run-id", "bad", *flags])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs" / "bad").exists()  # refused before any work
