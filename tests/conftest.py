"""Test-session settings: Prefect without network or telemetry, one embedded server for the session
(started lazily by the fixture that needs it), and a thread count that suits a shared 2-core machine."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("K3RL_TASK_RETRIES", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
