"""Test-session settings: Prefect without network or telemetry, one embedded server for the session
(started lazily by the fixture that needs it), a thread count that suits a shared 2-core machine,
and a local S3 server (``local_s3``, started by the first test that asks for it)."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("K3RL_TASK_RETRIES", "1")

import pytest  # noqa: E402


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


@pytest.fixture(scope="session")
def local_s3():
    """A real S3 server for the session: moto's, on 127.0.0.1 at a free port, with storage-layer
    fault injection (``tests/s3_local.py``). Needs the ``s3`` extra (s3fs, moto[server]), which the
    ``test`` extra includes."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("k3rl_test_s3_local", Path(__file__).with_name("s3_local.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    server = mod.LocalS3()
    try:
        yield server
    finally:
        server.stop()
