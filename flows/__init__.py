"""Prefect flows of the k3rl pipeline and the ``k3rl`` CLI.

Importing this package sets (only where unset) the Prefect environment k3rl needs before Prefect is
imported: no telemetry (machines here have no network), and an embedded-server start-up timeout that
a first start on 2 cores (database migrations, ~20-30 s) fits in.
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
