"""Every stage that reads a published table (score, the train step, the mismatch metric, the
reference) reads it through ``tasks.common.read_table``, which checks its bytes against the sha256
recorded when it was published: a table flipped by one bit, edited, or rewritten with other rows is
refused naming the file, never trained or scored on."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3core.artifacts import ArtifactStore
from tasks.common import ChangedArtifact, read_table


def _published(tmp_path):
    store = ArtifactStore(str(tmp_path / "root"))
    table = pa.table({"prompt": ["a", "b"], "reward": [0.25, 1.0]})
    with store.publish("runs/r/iter-0000/scored.parquet") as tmp:
        pq.write_table(table, tmp)
    return store.handle("runs/r/iter-0000/scored.parquet", "parquet"), table


def test_an_untouched_table_reads_as_published(tmp_path):
    handle, table = _published(tmp_path)
    assert read_table(handle).equals(table)
    assert read_table(handle, columns=["reward"]).column("reward").to_pylist() == [0.25, 1.0]


@pytest.mark.parametrize("how", ["one bit", "rows rewritten"])
def test_a_changed_table_is_refused_naming_the_file(tmp_path, how):
    handle, table = _published(tmp_path)
    path = tmp_path / "root" / "runs" / "r" / "iter-0000" / "scored.parquet"
    if how == "one bit":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
    else:  # a well-formed table with other rewards: parquet's own checks cannot see it
        pq.write_table(pa.table({"prompt": ["a", "b"], "reward": [1.0, 1.0]}), path)
    with pytest.raises(ChangedArtifact, match=r"runs/r/iter-0000/scored.parquet changed since it was published"):
        read_table(handle)
