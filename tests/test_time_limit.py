"""The suite's own rule (``tests/conftest.py``): an unmarked test may not take longer than the limit
of wall time and CPU time both; ``slow`` and ``gpu`` tests may. Checked by running pytest on a
throwaway test file beside a copy of the conftest, with the limit lowered to a fraction of a second."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

BODY = '''
import time
import pytest

def _spin(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass

def test_busy_unmarked():
    _spin(0.6)

@pytest.mark.slow
def test_busy_slow():
    _spin(0.6)

def test_sleeping_unmarked():
    time.sleep(0.6)  # wall time alone: a loaded machine, not a long test

def test_quick_unmarked():
    pass

def test_busy_and_failing_unmarked():
    _spin(0.6)
    assert False, "its own failure"
'''


def test_only_long_unmarked_tests_fail(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(BODY)
    env = {**os.environ, "K3RL_UNMARKED_LIMIT_S": "0.3"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", "-o", "addopts=",
                          "-o", "markers=slow", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    lines = {ln.split(" ")[1].split("::")[-1]: ln.split(" ")[0] for ln in out.stdout.splitlines()
             if ln.startswith(("PASSED ", "FAILED "))}
    assert lines == {"test_busy_unmarked": "FAILED", "test_busy_slow": "PASSED", "test_sleeping_unmarked": "PASSED",
                     "test_quick_unmarked": "PASSED", "test_busy_and_failing_unmarked": "FAILED"}, out.stdout
    assert "over the 0 s an unmarked test may take: mark it @pytest.mark.slow" in out.stdout
    assert "its own failure" in out.stdout
