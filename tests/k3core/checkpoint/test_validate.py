"""validate_checkpoint fails closed: each corruption below is caught by the named check, no report
is published, and the CLI exits non-zero. Reference: checkpoints written by save_hf (themselves
checked against the safetensors reader in test_hf_layout.py) and the safetensors writer for the
corrupted variants."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flows.cli_checkpoint import add_checkpoint_subcommands
from k3core.checkpoint.hf import INDEX_NAME, init_checkpoint, load_model, read_index, save_hf
from k3core.checkpoint.manifest import MANIFEST_NAME, write_manifest
from k3core.checkpoint.pin import make_pin
from k3core.checkpoint.validate import CheckpointValidationError, validate_checkpoint
from k3core.config import K3Config

P = "language_model.model."


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    init_checkpoint("tiny", root / "bf16", seed=1, max_shard_bytes=60_000)
    init_checkpoint("tiny", root / "mxfp4", seed=1, format="mxfp4", max_shard_bytes=60_000)
    return root


@pytest.fixture
def bf16(built, tmp_path) -> Path:
    return Path(shutil.copytree(built / "bf16", tmp_path / "ck"))


@pytest.fixture
def mxfp4(built, tmp_path) -> Path:
    return Path(shutil.copytree(built / "mxfp4", tmp_path / "ck"))


def edit(ck: Path, fn, shard_of: str | None = None, new_shard: str | None = None) -> None:
    """Rewrite the shard holding ``shard_of`` (or create ``new_shard``) with ``fn(tensors) -> tensors``
    and make the index follow the shard's new key set."""
    wm = read_index(ck)
    shard = new_shard or wm[shard_of]
    tensors = {}
    if new_shard is None:
        with safe_open(str(ck / shard), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors = fn(tensors)
    save_file(tensors, ck / shard, metadata={"format": "pt"})
    wm = {k: v for k, v in wm.items() if v != shard}
    wm.update({k: shard for k in tensors})
    index = json.loads((ck / INDEX_NAME).read_text())
    index["weight_map"] = dict(sorted(wm.items()))
    (ck / INDEX_NAME).write_text(json.dumps(index, indent=2))
    write_manifest(ck)  # an edit made on purpose, manifest rewritten: the structural checks must catch it


def fails(ck: Path, check: str, match: str = "", **kw) -> None:
    report = ck.parent / "report.json"
    report.write_text("{stale}")
    with pytest.raises(CheckpointValidationError, match=match) as e:
        validate_checkpoint(ck, report_path=report, **kw)
    assert e.value.check == check, str(e.value)
    assert not report.exists()  # no report unless everything passes


def test_valid_checkpoints_pass_with_an_atomic_report(bf16, tmp_path):
    pin = make_pin(bf16)
    rep = validate_checkpoint(bf16, pin=pin, report_path=tmp_path / "r.json", roundtrip=True)
    assert json.loads((tmp_path / "r.json").read_text()) == rep
    c = rep["counts"]
    assert c["index_keys"] == c["stored_text_tensors"] == c["text_tensors"] == len(read_index(bf16))
    assert c["mxfp4_pairs"] == 0 and c["shards"] == len(set(read_index(bf16).values())) > 2
    assert rep["roundtrip"]["tensors"] == c["index_keys"] and rep["pin"]["files_checked"] == c["shards"] + 2
    assert rep["files"]["config.json"]["sha256"] == pin.config_sha256
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temp report is gone


def test_mxfp4_checkpoint_passes(mxfp4):
    rep = validate_checkpoint(mxfp4, roundtrip=True)
    assert rep["format"] == "mxfp4"
    assert rep["counts"]["mxfp4_pairs"] == 3 * 8 * 3  # MoE layers x experts x (w1, w3, w2)
    assert rep["counts"]["index_keys"] == rep["counts"]["text_tensors"] + rep["counts"]["mxfp4_pairs"]


def test_flipped_byte_vs_pin(bf16):
    pin = make_pin(bf16)
    shard = sorted(set(read_index(bf16).values()))[1]
    b = bytearray((bf16 / shard).read_bytes())
    b[len(b) // 2] ^= 0x10
    (bf16 / shard).write_bytes(bytes(b))
    fails(bf16, "pin", shard, pin=pin)
    fails(bf16, "manifest", shard)  # structurally fine: only the hash can tell, and k3rl's manifest does
    (bf16 / MANIFEST_NAME).unlink()
    validate_checkpoint(bf16)  # a checkpoint from elsewhere has no manifest: only a pin can tell


def test_truncated_shard(bf16):
    shard = sorted(set(read_index(bf16).values()))[0]
    b = (bf16 / shard).read_bytes()
    (bf16 / shard).write_bytes(b[:-7])
    fails(bf16, "shard_format", "truncated")


def test_missing_tensor(bf16):
    key = P + "layers.2.mlp_res_norm.weight"
    edit(bf16, lambda t: {k: v for k, v in t.items() if k != key}, shard_of=key)
    fails(bf16, "missing_tensor", "mlp_res_norm")


def test_tensor_in_shard_but_not_in_index(bf16):
    key = P + "layers.2.mlp_res_norm.weight"
    edit(bf16, lambda t: {k: v for k, v in t.items() if k != key}, shard_of=key)
    index = json.loads((bf16 / INDEX_NAME).read_text())
    index["weight_map"][key] = read_index(bf16)[P + "norm.weight"]  # index claims it elsewhere
    (bf16 / INDEX_NAME).write_text(json.dumps(index))
    fails(bf16, "missing_tensor", "does not hold it")


def test_extra_tensor(bf16):
    key = P + "norm.weight"
    edit(bf16, lambda t: {**t, P + "layers.0.mlp.bias": torch.zeros(3, dtype=torch.bfloat16)}, shard_of=key)
    fails(bf16, "unexpected_tensor", "layers.0.mlp.bias")


@pytest.mark.parametrize("key,change,check", [
    (P + "layers.1.self_attn.q_proj.weight", lambda t: t.half(), "dtype"),
    (P + "layers.1.self_attn.dt_bias", lambda t: t.bfloat16(), "dtype"),  # fp32 must stay fp32
    (P + "layers.1.self_attn.q_proj.weight", lambda t: t[:-1].contiguous(), "shape"),
    (P + "layers.1.self_attn.A_log", lambda t: t[:2].contiguous(), "shape"),  # must be stored padded
])
def test_wrong_dtype_or_shape(bf16, key, change, check):
    edit(bf16, lambda t: {**t, key: change(t[key])}, shard_of=key)
    fails(bf16, check, key.split(".")[-2])


def test_unpaired_weight_scale(mxfp4):
    packed = P + "layers.1.block_sparse_moe.experts.3.w2.weight_packed"
    edit(mxfp4, lambda t: {k: v for k, v in t.items() if k != packed}, shard_of=packed)
    fails(mxfp4, "mxfp4_pair", "experts.3.w2.weight_scale")


def test_weight_scale_in_a_bf16_checkpoint(bf16):
    key = P + "layers.1.block_sparse_moe.experts.0.w1.weight"
    edit(bf16, lambda t: {**t, key[:-len("weight")] + "weight_scale": torch.zeros(32, 2, dtype=torch.uint8)}, shard_of=key)
    fails(bf16, "mxfp4_pair", "weight_scale")


def test_pair_split_across_shards(mxfp4):
    scale = P + "layers.2.block_sparse_moe.experts.0.w1.weight_scale"
    moved = {}

    def take(t):
        moved[scale] = t.pop(scale)
        return t
    edit(mxfp4, take, shard_of=scale)
    edit(mxfp4, lambda t: moved, new_shard="model-extra.safetensors")
    fails(mxfp4, "mxfp4_pair", "share a shard")


def test_quantization_config_must_be_the_release_declaration(mxfp4):
    cfg = json.loads((mxfp4 / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    (mxfp4 / "config.json").write_text(json.dumps(cfg))
    fails(mxfp4, "quantization_config", "config_groups")


@pytest.mark.parametrize("which", ["config.json", INDEX_NAME])
def test_config_or_index_not_matching_the_pin(bf16, which):
    pin = make_pin(bf16, per_file=False)
    d = json.loads((bf16 / which).read_text())
    (bf16 / which).write_text(json.dumps(d, indent=1))  # same content, other bytes
    fails(bf16, "pin", which, pin=pin)


def test_config_of_another_model(bf16):
    fails(bf16, "config", "hidden_size", config=K3Config.preset("tiny").replace(hidden_size=96))


def test_vision_tower_is_out_of_scope_not_unexpected(bf16):
    tensors = {"vision_tower.patch_embed.weight": torch.zeros(4, 3, dtype=torch.bfloat16),
               "mm_projector.linear_1.weight": torch.zeros(2, 4, dtype=torch.bfloat16)}
    edit(bf16, lambda t: tensors, new_shard="model-vision.safetensors")
    rep = validate_checkpoint(bf16, roundtrip=True)
    assert rep["counts"]["out_of_scope_tensors"] == 2
    assert rep["out_of_scope"]["shards_with_any"] == ["model-vision.safetensors"]


def test_roundtrip_keeps_signed_zeros_and_nan_payloads(bf16, tmp_path):
    key = P + "layers.0.mlp.gate_proj.weight"
    bits = torch.tensor([0x8000, 0x7FC1, 0xFFA5, 0x7F81], dtype=torch.int32).to(torch.int16)  # -0, NaNs with payloads

    def poke(t):
        w = t[key].clone()
        w.view(torch.int16).view(-1)[:4] = bits
        return {**t, key: w}
    edit(bf16, poke, shard_of=key)
    validate_checkpoint(bf16, roundtrip=True)  # bitwise through public -> native -> public
    save_hf(load_model(bf16), tmp_path / "again", max_shard_bytes=60_000)  # and through the real loader/writer
    with safe_open(str(tmp_path / "again" / read_index(tmp_path / "again")[key]), "pt") as f:
        assert f.get_tensor(key).view(torch.int16).view(-1)[:4].tolist() == bits.tolist()


def test_roundtrip_catches_a_log_padding(bf16):
    key = P + "layers.1.self_attn.A_log"

    def pad(t):
        a = t[key].clone()
        a[-1] = -0.0  # a signed zero in the padding: not +0, not re-exportable
        return {**t, key: a}
    edit(bf16, pad, shard_of=key)
    validate_checkpoint(bf16)
    fails(bf16, "roundtrip", "padding", roundtrip=True)


def test_cli_validate_exit_codes(bf16, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="k3rl")
    add_checkpoint_subcommands(parser.add_subparsers(dest="cmd"))
    pin = tmp_path / "pin.json"
    pin.write_text(json.dumps(make_pin(bf16).to_dict()))
    args = parser.parse_args(["checkpoint", "validate", str(bf16), "--pin", str(pin), "--report", str(tmp_path / "r.json")])
    assert args.fn(args) == 0 and (tmp_path / "r.json").exists()
    (bf16 / "config.json").write_text((bf16 / "config.json").read_text() + " ")
    args = parser.parse_args(["checkpoint", "validate", str(bf16), "--pin", str(pin), "--report", str(tmp_path / "r.json")])
    assert args.fn(args) != 0 and not (tmp_path / "r.json").exists()
    assert "[pin]" in capsys.readouterr().err


def _set_text_config(ck: Path, **fields) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"].update(fields)
    (ck / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("field,value,held", [("num_hidden_layers", 5, "4 layers"),
                                              ("num_experts", 9, "8 routed experts")])
def test_a_config_describing_more_than_its_index_holds_fails_the_config_check(bf16, field, value, held):
    """One more layer or expert than the tensors hold is found from the index, before the config is
    built (where it would otherwise surface as missing tensors of the layout)."""
    _set_text_config(bf16, **{field: value})
    fails(bf16, "config", f"{field} is {value}, but {INDEX_NAME} holds tensors of {held}")


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**9), ("num_experts", 10**7)])
def test_a_hostile_config_is_refused_within_a_small_address_space(bf16, field, value):
    """``checkpoint validate`` is the tool for untrusted checkpoints: a size field of a billion must
    be refused without sizing anything from it (it drove validation to ~20 GB and the OOM killer).
    The subprocess runs under a 3 GiB address-space limit, so an allocation from the field fails it."""
    import subprocess
    import sys

    _set_text_config(bf16, **{field: value})
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from flows.cli import main; sys.exit(main(['checkpoint', 'validate', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", code, str(bf16)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "[config]" in r.stderr and f"{field} is {value}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr


@pytest.mark.parametrize("which", ["config.json", INDEX_NAME])
def test_json_nested_past_the_recursion_limit_names_the_file(bf16, which):
    text = (bf16 / which).read_text().rstrip()
    (bf16 / which).write_text(text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    fails(bf16, "config" if which == "config.json" else "index", f"{which}: nests too deeply")
