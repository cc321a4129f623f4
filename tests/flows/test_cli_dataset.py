"""`k3rl run` refuses a bad dataset environment or reward-sandbox setting before any work: exit 2 and
one message naming the problem, no traceback, nothing written."""

import pytest

from flows.cli import main


@pytest.mark.parametrize("extra, says", [
    (["--env", "dataset:math:/nonexistent-k3rl/d.jsonl"], "cannot read /nonexistent-k3rl/d.jsonl"),
    (["--env", "dataset:poetry:d.jsonl"], "VERIFIER one of math, code"),
    (["--env", "dataset:math:{tmp}/d.txt"], "must end in .parquet or .jsonl"),
    (["--reward-timeout", "0"], "--reward-timeout must be a positive number of seconds"),
    (["--reward-workers", "0"], "--reward-workers must be >= 1"),
    (["--reward-memory-mb", "8"], "--reward-memory-mb must be >= 64"),
])
def test_bad_dataset_or_sandbox_settings_exit_2_before_any_work(tmp_path, capsys, extra, says):
    (tmp_path / "d.txt").write_text("")
    root = tmp_path / "artifacts"
    argv = ["run", "--preset", "tiny", "--run-id", "x", "--artifacts", str(root)] + [a.format(tmp=tmp_path) for a in extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3rl: error: ") and says in err and "Traceback" not in err
    assert not root.exists()
