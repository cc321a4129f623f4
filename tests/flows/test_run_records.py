"""Run records that are not what k3rl writes (``metrics.json``, ``lineage.json``, ``latest.json``,
``summary.json`` edited, truncated, or nested past any sane depth): ``k3rl run`` and ``k3rl status``
stop with one ``k3rl: error:`` line naming the file and the fix, exit 2, before any work and without a
traceback; nothing is written (but the run lock, taken and released)."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from k3core.artifacts import COMPLETE
from k3core.rl.layout import RunRecordError, parse_record

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads alone: RecursionError


@pytest.mark.parametrize("name, text, says", [
    ("metrics.json", "[{\"iteration\": 0", "metrics.json is not valid JSON"),
    ("metrics.json", "{\"iteration\": 0}", "metrics.json holds dict, not a list of per-iteration metrics"),
    ("metrics.json", "[1, 2]", "is not a k3rl run record (TypeError"),
    ("lineage.json", DEEP, "lineage.json nests deeper than 64 levels"),
    ("lineage.json", "{\"iterations\": [[{\"kind\": \"dcp\"}]]}", "is not a k3rl run record (TypeError"),
    ("summary.json", "[]", "summary.json holds list, not an object summarising the run"),
])
def test_a_broken_record_stops_the_run_naming_the_file(tmp_path, capsys, name, text, says):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text("[]")
    (run / "lineage.json").write_text(json.dumps({"iterations": []}))
    (run / name).write_text(text)
    before = {p: p.read_bytes() for p in run.iterdir()}
    rc = main(["run", "--preset", "tiny", "--source", "init:tiny:0", "--run-id", "r", "--artifacts", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in err, err
    assert "restore" in errors[0]  # and the fix
    assert {p: p.read_bytes() for p in run.iterdir() if p.name != ".lock"} == before  # the run lock, released


def test_status_names_a_broken_latest_pointer(tmp_path, capsys):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "latest.json").write_text("{\"iteration\": ")
    assert main(["status", "--run-id", "r", "--artifacts", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "latest.json is not valid JSON" in err and "Traceback" not in err, err


def test_records_k3rl_writes_parse_and_strings_do_not_count_as_nesting():
    assert parse_record(json.dumps([{"a": "[[[[" * 50}]), "x/metrics.json") == [{"a": "[[[[" * 50}]
    with pytest.raises(RunRecordError, match="nests deeper"):
        parse_record("[" * 65 + "]" * 65, "x/metrics.json")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("variable", ["PREFECT_API_URL", "PREFECT_HOME"])
def test_a_prefect_setting_that_cannot_work_is_named_before_any_work(tmp_path, capsys, monkeypatch, variable):
    """A PREFECT_API_URL with nothing listening, a PREFECT_HOME that is a file: one line naming the
    variable and the fix, exit 2, no traceback, nothing of the run made."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    bad = f"http://127.0.0.1:{_free_port()}/api" if variable == "PREFECT_API_URL" else str(tmp_path / "a-file")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(variable, bad)
    setting = PREFECT_API_URL if variable == "PREFECT_API_URL" else PREFECT_HOME
    with temporary_settings({setting: bad}):
        rc = main(["run", "--preset", "tiny", "--source", "init:tiny:0", "--run-id", "r", "--artifacts",
                   str(tmp_path / "root")])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert rc == 2 and len(errors) == 1 and f"{variable}={bad}" in errors[0] and "Traceback" not in err, err
    assert "unset" in errors[0]
    assert not list((tmp_path / "root").glob("runs/r/*.json")) and not (tmp_path / "root" / "runs" / "r" / "source").exists()


def _recorded(root, run_id, checkpoint_uri, checkpoint_path):
    """A run ``run_id`` under ``root`` that recorded one iteration whose trainer state is at the given
    URI and path, with its own checkpoint directory in place."""
    run = root / "runs" / run_id
    (run / "checkpoints" / "iter-0001").mkdir(parents=True)
    (run / "checkpoints" / "iter-0001" / COMPLETE).write_text("")
    (run / "metrics.json").write_text(json.dumps([{"iteration": 0}]))
    state = {"kind": "dcp", "uri": checkpoint_uri, "path": checkpoint_path, "sha256": "0" * 64, "version": 1,
             "info": {"manifest": "x"}}
    (run / "lineage.json").write_text(json.dumps({"iterations": [[state]]}))
    return run


def test_a_lineage_naming_another_runs_state_stops_the_run(tmp_path, capsys):
    other = (tmp_path / "runs" / "other" / "checkpoints" / "iter-0001")
    other.mkdir(parents=True)
    _recorded(tmp_path, "r", other.as_uri(), str(other / "state"))
    rc = main(["run", "--preset", "tiny", "--source", "init:tiny:0", "--run-id", "r", "--artifacts", str(tmp_path),
               "--iterations", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "names a trainer state outside this run" in err and "Traceback" not in err, err


def test_a_copied_artifact_root_resumes_from_its_own_checkpoints(tmp_path):
    """The records name the original root (still on this machine); the copy reads its own files."""
    from flows.reports import finished_iterations
    from k3core.settings import RLSettings

    original = tmp_path / "original" / "runs" / "r" / "checkpoints" / "iter-0001"
    original.mkdir(parents=True)
    copy = tmp_path / "copy"
    _recorded(copy, "r", original.as_uri(), str(original / "state"))
    s = RLSettings.from_dict(dict(preset="tiny", artifacts=str(copy), run_id="r", iterations=2))
    _, done = finished_iterations(s)
    (state,) = done[0]
    mine = copy / "runs" / "r" / "checkpoints" / "iter-0001"
    assert state.uri == mine.as_uri() and state.path == str(mine / "state")
