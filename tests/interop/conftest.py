"""The interop suite imports SGLang's own modules (``pip install --no-deps sglang``, see ``make setup``);
``sglang_cpu`` puts the few CPU stubs in place first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402

import sglang_cpu  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _sglang_cpu_teardown():
    """A module here may initialise SGLang's process groups and stub torchvision: undone after each module
    (pytest has no per-directory scope here), so the rest of the session (DCP, transformers) sees a plain
    process."""
    yield
    sglang_cpu.teardown()
