"""Run records that are not what k3rl writes (``metrics.json``, ``lineage.json``, ``latest.json``,
``summary.json`` edited, truncated, or nested past any sane depth): ``k3rl run`` and ``k3rl status``
stop with one ``k3rl: error:`` line naming the file and the fix, exit 2, before any work and without a
traceback; nothing is written (but the run lock, taken and released)."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
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
