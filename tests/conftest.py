"""Test-session settings: Prefect without network or telemetry, one embedded server for the session
(started lazily by the fixture that needs it), a thread count that suits a shared 2-core machine,
and a local S3 server (``local_s3``, started by the first test that asks for it)."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("K3RL_TASK_RETRIES", "1")
# One intra-op thread per process, for this process and the runs it starts: `make test` runs several
# pytest-xdist workers on two cores, and torch's default of one thread per core per process then
# oversubscribes the machine, where barrier waits cost more than a second thread gains on the
# suite's small tensors (docs/results/test_suite.md: with two workers the suite took a fifth less
# time). Set before anything imports torch; an explicit OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import resource  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

# An unmarked test may take at most this long (``make test-quick`` deselects ``slow`` and must stay
# the inner loop); a longer one is marked ``slow`` (or made shorter).
UNMARKED_LIMIT_S = float(os.environ.get("K3RL_UNMARKED_LIMIT_S", "20"))


def _cpu_seconds() -> float:
    """CPU time of this process and of the child processes it has waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail a test not marked ``slow`` (or ``gpu``) whose body takes more than ``UNMARKED_LIMIT_S``
    of wall time and also of CPU time. Either alone misleads on a shared 2-core machine: wall time
    grows with the load of other processes, CPU time with torch's threads. Fixture setup is not
    counted: a module's or session's fixture is paid once, by whichever test comes first."""
    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
    out = yield  # a failing test keeps its own failure
    wall, cpu = time.perf_counter() - wall0, _cpu_seconds() - cpu0
    unmarked = item.get_closest_marker("slow") is None and item.get_closest_marker("gpu") is None
    if unmarked and min(wall, cpu) > UNMARKED_LIMIT_S:
        pytest.fail(f"{item.nodeid} took {wall:.0f} s of wall time and {cpu:.0f} s of CPU time, over the "
                    f"{UNMARKED_LIMIT_S:.0f} s an unmarked test may take: mark it @pytest.mark.slow (make "
                    "test-quick skips it) or make it shorter", pytrace=False)
    return out


def pytest_collection_modifyitems(config, items):
    """Files with ``slow`` tests first, the rest after, each file's tests in their own order. With
    pytest-xdist handing whole files to its workers (``make test``: ``--dist loadfile``), the long
    files then start at once and the short ones fill in behind them, instead of one long file
    starting last and running alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: within a file, the order stays


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny tensors: on a shared 2-core CPU, torch's intra-op
    threads only add barrier waits (observed ~100x slower per op under load). Modules take it with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def helper_module(name: str, folder: str = ""):
    """A helper module of ``tests/`` (``s3_local``, ``prefect_local``; ``folder``: a subfolder of it,
    ``flows`` for ``test_kill_matrix``): the suite imports in ``importlib`` mode, which puts no test
    directory on ``sys.path``."""
    import importlib.util
    import sys
    from pathlib import Path

    key = f"k3rl_test_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).parent / folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


@pytest.fixture(scope="session")
def kill_matrix():
    """``tests/flows/test_kill_matrix.py`` as a module: the command, its baseline and the comparison,
    for the chains of other files (a full disk, stop signals)."""
    return helper_module("test_kill_matrix", "flows")


@pytest.fixture(scope="session")
def kill_matrix_baseline(tmp_path_factory, prefect_server, kill_matrix):
    """The kill matrix's command (``kill_matrix.ARGS``) run once, never killed: its final state
    (``kill_matrix._final_state``), the run that every chain of the kill matrix, the stop signals
    and the full disk must end equal to. Run once per test session, not once per file: the first
    pytest-xdist worker to ask runs it holding a lock in the session's shared temporary root (the
    parent of each worker's own), the others wait for it and read its artifacts."""
    import fcntl

    own = tmp_path_factory.getbasetemp()
    shared = own.parent if os.environ.get("PYTEST_XDIST_WORKER") else own
    base = shared / "kill-matrix-baseline"
    with open(shared / "kill-matrix-baseline.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker dies
        if not (base / "finished").exists():
            done, _ = kill_matrix._k3rl(base / "artifacts", base / "prefect-home", None, prefect_server.api)
            assert done.returncode == 0, done.stdout[-3000:]
            (base / "finished").write_text("")
    return kill_matrix._final_state(base / "artifacts")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One real ``prefect server start`` for the session (``tests/prefect_local.py``), for end-to-end
    chains of ``k3rl run`` processes that report to a server (``PREFECT_API_URL``) instead of each
    starting an embedded one. Tests that need a server configured their own way start their own."""
    server = helper_module("prefect_local").PrefectServer(tmp_path_factory.mktemp("prefect-server")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def local_s3():
    """A real S3 server for the session: moto's, on 127.0.0.1 at a free port, with storage-layer
    fault injection (``tests/s3_local.py``). Needs the ``s3`` extra (s3fs, moto[server]), which the
    ``test`` extra includes."""
    server = helper_module("s3_local").LocalS3()
    try:
        yield server
    finally:
        server.stop()
