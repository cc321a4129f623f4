"""Stage results are persisted as JSON and nothing else is read back: a pickle planted where a cached
result lives is never unpickled (the stage runs again and overwrites it), and a real JSON record
still makes the stage a cache hit."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest

from k3core.artifacts import Artifact
from tasks.common import Run
from tasks.results import StageResultSerializer, declared_serializer, refuse_untrusted


class _Payload:
    """Unpickling this writes a marker file: proof that code from the artifact root ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def test_serializer_round_trips_artifacts_and_json_only():
    ser = StageResultSerializer()
    a = Artifact("dcp", "file:///x", "/x", "ab" * 32, 3, {"metrics": {"loss": 0.5}, "qat": False}, "train_step-iter2",
                 ("file:///a", "file:///b"))
    out = ser.loads(ser.dumps({"state": a, "n": [1, 2.5, None, "s"]}))
    assert out == {"state": a, "n": [1, 2.5, None, "s"]} and out["state"].inputs == ("file:///a", "file:///b")
    assert out["state"].info == a.info
    with pytest.raises(TypeError, match="JSON values and Artifact handles"):
        ser.dumps({"x": object()})
    # a class name inside the data is just data: nothing is imported or called
    assert ser.loads(json.dumps({"__class__": "os.system", "data": "echo hi"}).encode()) == {
        "__class__": "os.system", "data": "echo hi"}


def test_records_that_are_not_k3rl_json_are_moved_aside(tmp_path):
    marker = tmp_path / "marker"
    planted = {"metadata": {"serializer": {"type": "pickle"}, "storage_key": "k"},
               "result": base64.b64encode(pickle.dumps(_Payload(str(marker)))).decode()}
    (tmp_path / "k").write_text(json.dumps(planted))
    (tmp_path / "raw").write_bytes(pickle.dumps(_Payload(str(marker))))
    ok = {"metadata": {"serializer": {"type": "k3rl-json"}}, "result": "{}"}
    (tmp_path / "ok").write_text(json.dumps(ok))
    assert refuse_untrusted(tmp_path / "k") and refuse_untrusted(tmp_path / "raw")
    assert not refuse_untrusted(tmp_path / "ok") and not refuse_untrusted(tmp_path / "missing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.refused", "ok", "raw.refused"]
    assert declared_serializer(b"\x80\x04junk") is None and not marker.exists()


def test_a_planted_pickle_in_the_result_store_is_never_run(tmp_path, prefect_harness):
    from tasks.fetch import fetch_checkpoint

    run = Run(str(tmp_path / "art"), "p")
    first = fetch_checkpoint(run, "init:tiny:1")
    results = Path(run.artifacts) / ".prefect-results"
    records = [p for p in results.iterdir() if p.is_file()]
    assert records, "the stage persisted no result"
    for rec in records:
        assert declared_serializer(rec.read_bytes()) == "k3rl-json"
        json.loads(rec.read_bytes())  # JSON all the way down
    again = fetch_checkpoint(run, "init:tiny:1")  # a cache hit from the JSON record
    assert again == first

    # replace every record with a pickle record whose payload writes a marker when unpickled
    marker = tmp_path / "marker"
    payload = base64.b64encode(pickle.dumps(_Payload(str(marker)))).decode()
    for rec in records:
        meta = json.loads(rec.read_bytes())["metadata"]
        rec.write_text(json.dumps({"metadata": {**meta, "serializer": {"type": "pickle"}}, "result": payload}))
    third = fetch_checkpoint(run, "init:tiny:1")
    assert not marker.exists(), "a pickle from the artifact root was unpickled"
    assert third == first  # the stage ran again, found its published checkpoint, and answered the same
    assert all(declared_serializer(rec.read_bytes()) == "k3rl-json" for rec in records)  # a JSON record again
    assert {p.name for p in results.iterdir()} >= {rec.name + ".refused" for rec in records}
    # the plant was live: Prefect's own record reader runs it
    from prefect._internal.result_records import ResultRecord

    ResultRecord.deserialize((results / (records[0].name + ".refused")).read_bytes())
    assert marker.read_text() == "pwned"
