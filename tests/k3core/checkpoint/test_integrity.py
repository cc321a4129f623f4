"""Checkpoint integrity: k3rl's manifests are checked by validate and by every load, and nothing in a
trainer state (DCP) is unpickled unchecked.

The planted payloads are live: the stock reader (plain ``pickle`` / ``dcp.load``) runs each of them in
this process (it writes a marker file), which the tests show first; k3rl's readers must refuse the
same bytes with the marker never written. References: the model's own state dict before saving, and
``pickle.loads`` of an untouched ``.metadata``."""

from __future__ import annotations

import argparse
import builtins
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from flows.cli_checkpoint import add_checkpoint_subcommands
from k3core.checkpoint.dcp_safe import (UnsafePickleError, VerifiedFileSystemReader, restricted_loads, safe_dcp_load,
                                        validate_dcp)
from k3core.checkpoint.hf import init_checkpoint, load_hf, load_model, quantize_checkpoint, read_index
from k3core.checkpoint.manifest import MANIFEST_NAME, ManifestError, read_manifest, write_manifest
from k3core.checkpoint.validate import CheckpointValidationError, validate_checkpoint
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.trainer_state import load_trainer_state, make_optimizer, save_trainer_state


class Payload:
    """Unpickling this runs ``open(marker, 'w').write('ran')``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('ran')",)


def cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="k3rl")
    add_checkpoint_subcommands(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["checkpoint", *argv])
    return args.fn(args)


def flip(path: Path, offset: int | None = None) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(b))


@pytest.fixture(scope="module")
def public(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pub")
    init_checkpoint("tiny", root / "ck", seed=3, max_shard_bytes=60_000)
    return root / "ck"


@pytest.fixture
def ck(public, tmp_path) -> Path:
    return Path(shutil.copytree(public, tmp_path / "ck"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ts")
    torch.manual_seed(0)
    m = K3ForCausalLM(K3Config.preset("tiny"))
    opt = make_optimizer(m, 1e-3)
    ids = torch.randint(0, 256, (2, 8))
    opt.zero_grad()
    m(ids, targets=ids.roll(-1, 1)).loss.backward()
    opt.step()
    save_trainer_state(root / "state", m, opt, {"iteration": 1})
    return root / "state", {k: v.clone() for k, v in m.state_dict().items()}


@pytest.fixture
def state(trained, tmp_path) -> Path:
    return Path(shutil.copytree(trained[0], tmp_path / "state"))


# ------------------------------------------------------------------------ public checkpoints
def test_manifest_lists_every_file_and_validate_checks_it(ck):
    m = read_manifest(ck)
    assert set(m["files"]) == {p.name for p in ck.iterdir() if p.name != MANIFEST_NAME}
    rep = validate_checkpoint(ck)
    assert rep["manifest"] == {"checked": True, "files_checked": len(m["files"])}
    assert MANIFEST_NAME not in rep["unreferenced_files"]


def test_flipped_byte_fails_validate_and_every_load_naming_the_file(ck, tmp_path, capsys):
    shard = sorted(set(read_index(ck).values()))[1]
    flip(ck / shard)
    with pytest.raises(CheckpointValidationError, match=rf"\[manifest\].*{shard}.*does not match"):
        validate_checkpoint(ck)
    for load in (load_hf, load_model):
        with pytest.raises(ManifestError, match=rf"{shard}: sha256 .* does not match"):
            load(ck)
    with pytest.raises(ManifestError, match=shard):
        quantize_checkpoint(ck, tmp_path / "q")
    assert not (tmp_path / "q").exists()
    assert cli("validate", str(ck)) == 1
    assert shard in capsys.readouterr().err
    assert cli("quantize", str(ck), str(tmp_path / "q")) == 1


def test_truncated_or_unlisted_files_are_refused(ck):
    shard = sorted(set(read_index(ck).values()))[0]
    (ck / shard).write_bytes((ck / shard).read_bytes()[:-1])
    with pytest.raises(ManifestError, match=rf"{shard}: \d+ bytes, the manifest says"):
        load_hf(ck)
    # a shard the index names but the manifest does not list is never read unchecked
    m = read_manifest(ck)
    del m["files"][shard]
    (ck / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=rf"{shard} is not in {MANIFEST_NAME}"):
        load_hf(ck)


def test_malformed_manifest_is_refused(ck):
    (ck / MANIFEST_NAME).write_text(json.dumps({"format": "k3rl.manifest/1", "algorithm": "sha256",
                                                "files": {"../x": {"sha256": "0" * 64, "size": 1}}}))
    with pytest.raises(ManifestError, match="not a relative path inside"):
        load_hf(ck)
    (ck / MANIFEST_NAME).write_text("{")
    with pytest.raises(CheckpointValidationError, match=r"\[manifest\].*not readable JSON"):
        validate_checkpoint(ck)


# ------------------------------------------------------------------------ DCP trainer states
def test_trainer_state_round_trips_through_the_checked_reader(trained):
    path, weights = trained
    assert ".metadata" in read_manifest(path)["files"]
    m2, _, extra = load_trainer_state(path, lr=1e-3)
    assert extra["iteration"] == 1
    for n, b in m2.state_dict().items():
        assert torch.equal(weights[n], b), n


def test_restricted_unpickler_reads_real_metadata_as_pickle_does(trained):
    data = (trained[0] / ".metadata").read_bytes()
    assert restricted_loads(data) == pickle.loads(data)


def test_planted_metadata_pickle_never_runs(state, tmp_path, capsys):
    marker = tmp_path / "ran"
    evil = pickle.dumps(Payload(marker))
    pickle.loads(evil)  # the payload is live under the stock unpickler
    assert marker.read_text() == "ran"
    marker.unlink()

    (state / ".metadata").write_bytes(evil)
    with pytest.raises(ManifestError, match=r"\.metadata: \d+ bytes, the manifest says"):
        load_trainer_state(state, lr=0.0)
    assert cli("validate", str(state)) == 1
    assert ".metadata" in capsys.readouterr().err
    assert not marker.exists()

    # an attacker who rewrites the manifest too: the hash now matches, the allowlist still refuses
    write_manifest(state)
    with pytest.raises(UnsafePickleError, match=r"refusing to unpickle global builtins\.exec"):
        load_trainer_state(state, lr=0.0)
    with pytest.raises(CheckpointValidationError, match=r"\[dcp_metadata\].*builtins\.exec"):
        validate_checkpoint(state)
    assert not marker.exists()


def test_metadata_swapped_after_the_manifest_check_is_refused(state, tmp_path):
    """The bytes unpickled are the bytes hashed: a .metadata replaced between the manifest check and
    the read does not get through."""
    reader = VerifiedFileSystemReader(state, read_manifest(state)["files"][".metadata"]["sha256"], set())
    (state / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / "ran")))
    with pytest.raises(UnsafePickleError, match="is not the recorded"):
        reader.read_metadata()
    assert not (tmp_path / "ran").exists()


def test_flipped_byte_in_a_dcp_shard_is_refused(state, capsys):
    shard = next(p for p in state.iterdir() if p.suffix == ".distcp")
    flip(shard)
    with pytest.raises(ManifestError, match=rf"{shard.name}: sha256 .* does not match"):
        load_trainer_state(state, lr=0.0)
    assert cli("validate", str(state)) == 1
    assert shard.name in capsys.readouterr().err


def test_trainer_state_without_manifest_is_refused(state):
    (state / MANIFEST_NAME).unlink()
    with pytest.raises(ManifestError, match=f"{MANIFEST_NAME} is missing"):
        load_trainer_state(state, lr=0.0)


def test_planted_pickle_in_a_dcp_item_never_runs(tmp_path):
    """DCP stores non-tensor items as pickles inside its data files; with the manifest rewritten to
    match (the worst case), the safe planner still refuses them."""
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "extra": Payload(marker)}, checkpoint_id=str(tmp_path / "d"))
    write_manifest(tmp_path / "d")
    dcp.load({"w": torch.zeros(3), "extra": ""}, checkpoint_id=str(tmp_path / "d"))  # stock: runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(UnsafePickleError, match="'extra'"):
        safe_dcp_load({"w": torch.zeros(3), "extra": ""}, tmp_path / "d")
    assert not marker.exists()


def test_validate_accepts_trainer_states_and_run_checkpoints(state, tmp_path):
    rep = validate_dcp(state)
    assert rep["format"] == "dcp" and rep["data_files"]
    run_ck = tmp_path / "iter-1"
    shutil.copytree(state, run_ck / "state")  # the layout save_checkpoint publishes
    assert validate_checkpoint(run_ck, report_path=tmp_path / "r.json")["ok"]
    assert json.loads((tmp_path / "r.json").read_text())["format"] == "dcp"
    assert cli("validate", str(run_ck)) == 0
