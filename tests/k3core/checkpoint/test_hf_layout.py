"""The public checkpoint layout: name mapping, save_hf/load_hf round trips, crash safety.

References: the model's own state_dict and dtypes after ``cast(bf16)`` (names, shapes, fp32 set),
the reference ``safetensors`` reader (every file we write), the architecture doc's release shapes,
and ``k3core.ops.mxfp4`` quantize -> dequantize for MXFP4 files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flows.cli_checkpoint import add_checkpoint_subcommands
from k3core.checkpoint.files import sha256_file
from k3core.checkpoint.manifest import MANIFEST_NAME
from k3core.checkpoint.hf import (CheckpointFormatError, INDEX_NAME, init_checkpoint, load_hf, load_model,
                                  quantize_checkpoint, read_index, save_hf)
from k3core.checkpoint.names import materialize, meta_model, native_shapes, native_to_public, public_layout
from k3core.checkpoint.safetensors_file import read_header
from k3core.config import K3Config, mxfp4_quantization_config
from k3core.model.k3 import K3ForCausalLM
from k3core.ops.mxfp4 import dequantize, quantize

P = "language_model.model."


def tiny(**kw) -> K3Config:
    return K3Config.preset("tiny").replace(**kw)


def seeded(config: K3Config, seed: int = 0, dtype=torch.bfloat16) -> K3ForCausalLM:
    m = materialize(meta_model(config))
    m.reset_parameters(seed)
    with torch.no_grad():  # reset leaves A_log and the router bias at zero: make them informative
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if name.endswith(("A_log", "e_score_correction_bias")):
                t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return m.cast(dtype)


def files_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# ------------------------------------------------------------------------------------ mapping
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_native_spec_is_the_model_and_dtypes_follow_it(preset):
    config = K3Config.preset(preset)
    model = K3ForCausalLM(config, init_weights=False).cast(torch.bfloat16)
    sd = model.state_dict()
    assert native_shapes(config) == {k: tuple(v.shape) for k, v in sd.items()}
    layout = public_layout(config)
    for ent in layout.entries:  # the public dtype is the dtype the model keeps after cast(bf16)
        assert ent.dtype == sd[ent.native].dtype, ent.public


@pytest.mark.parametrize("target", ["bf16", "mxfp4"])
def test_entries_partition_every_native_tensor(target):
    """Every native element belongs to exactly one public entry (no gap, no overlap)."""
    config = tiny()
    layout = public_layout(config, target)
    hits = {k: torch.zeros(s, dtype=torch.int32) for k, s in layout.native.items()}
    for ent in layout.entries:
        ent.native_view(hits[ent.native]).add_(1)
    for k, h in hits.items():
        assert bool((h == 1).all()), k
    # and the key set is exactly what the files hold: for mxfp4, experts as pairs only
    keys = set(layout.by_key)
    assert len(keys) == sum(len(e.stored()) for e in layout.entries)
    if target == "mxfp4":
        assert not any(k.endswith((".w1.weight", ".w2.weight", ".w3.weight")) for k in keys)


def test_release_shapes_and_counts_from_the_full_config():
    """The architecture doc's public facts, derived from the mapping rule and the full config."""
    config = K3Config()
    shapes = native_shapes(config)
    L = "model.layers.1."
    w13 = native_to_public(L + "block_sparse_moe.experts.w13", shapes[L + "block_sparse_moe.experts.w13"], config, "mxfp4")
    w2 = native_to_public(L + "block_sparse_moe.experts.w2", shapes[L + "block_sparse_moe.experts.w2"], config, "mxfp4")
    assert len(w13) == 2 * 896 and len(w2) == 896
    assert w13[0].stored() == [(P + "layers.1.block_sparse_moe.experts.0.w1.weight_packed", (3072, 1792), torch.uint8),
                               (P + "layers.1.block_sparse_moe.experts.0.w1.weight_scale", (3072, 112), torch.uint8)]
    assert w13[1].public == P + "layers.1.block_sparse_moe.experts.0.w3.weight"
    assert w2[5].stored() == [(P + "layers.1.block_sparse_moe.experts.5.w2.weight_packed", (3584, 1536), torch.uint8),
                              (P + "layers.1.block_sparse_moe.experts.5.w2.weight_scale", (3584, 96), torch.uint8)]
    one = lambda n: native_to_public(n, shapes[n], config)  # noqa: E731
    (a_log,) = one("model.layers.0.self_attn.A_log")
    assert a_log.shape == (128,) and a_log.dtype == torch.float32 and a_log.codec == "pad"
    assert [(e.public, e.shape) for e in one(L + "block_sparse_moe.shared_experts.gate_up_proj.weight")] == [
        (P + "layers.1.block_sparse_moe.shared_experts.gate_proj.weight", (6144, 7168)),
        (P + "layers.1.block_sparse_moe.shared_experts.up_proj.weight", (6144, 7168))]
    assert one(L + "block_sparse_moe.gate.weight")[0].shape == (896, 7168)
    (bias,) = one(L + "block_sparse_moe.gate.e_score_correction_bias")
    assert bias.public == P + "layers.1.block_sparse_moe.gate.e_score_correction_bias" and bias.dtype == torch.float32
    assert one("model.layers.0.self_attn.f_b_proj.weight")[0].shape == (12288, 128)
    assert one("lm_head.weight")[0].public == "language_model.lm_head.weight"
    # counts (MXFP4 pairs once): 249,756 logical text tensors; 247,296 pairs
    n_expert_mats = sum(s[0] * (2 if k.endswith("w13") else 1) for k, s in shapes.items() if k.endswith(("w13", "w2")))
    assert n_expert_mats == 247_296
    plain = sum(len(native_to_public(k, s, config)) for k, s in shapes.items() if not k.endswith(("w13", "w2")))
    assert plain + n_expert_mats == 249_756


def test_mapping_values_by_hand():
    """gate/up halves, expert rows, A_log padding: values checked by direct indexing."""
    config = tiny()
    m = seeded(config, 3)
    sd = m.state_dict()
    layout = public_layout(config)
    get = {e.public: e.to_public(sd[e.native]) for e in layout.entries}
    gu = sd["model.layers.0.mlp.gate_up_proj.weight"]
    I = config.intermediate_size
    assert torch.equal(get[P + "layers.0.mlp.gate_proj.weight"], gu[:I])
    assert torch.equal(get[P + "layers.0.mlp.up_proj.weight"], gu[I:])
    w13, w2 = sd["model.layers.2.block_sparse_moe.experts.w13"], sd["model.layers.2.block_sparse_moe.experts.w2"]
    Ie = config.moe_intermediate_size
    assert torch.equal(get[P + "layers.2.block_sparse_moe.experts.5.w1.weight"], w13[5, :Ie])
    assert torch.equal(get[P + "layers.2.block_sparse_moe.experts.5.w3.weight"], w13[5, Ie:])
    assert torch.equal(get[P + "layers.2.block_sparse_moe.experts.7.w2.weight"], w2[7])
    a = get[P + "layers.1.self_attn.A_log"]
    H = config.kda_num_heads
    assert a.shape == (config.kda_a_log_public_size,) and torch.equal(a[:H], sd["model.layers.1.self_attn.A_log"])
    assert a[H:].view(torch.int32).eq(0).all()


# ---------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("preset,shard", [("tiny", 40_000), ("small", 3_000_000)])
def test_bf16_round_trip_is_bit_exact(tmp_path, preset, shard):
    config = K3Config.preset(preset)
    model = seeded(config, 7)
    res = save_hf(model, tmp_path / "a", max_shard_bytes=shard)
    assert len(res.shards) > 2 and res.shards[0] == f"model-00001-of-{len(res.shards):05d}.safetensors"
    sd = model.state_dict()
    if preset == "tiny":  # the reference reader agrees with the mapping, tensor by tensor
        layout = public_layout(config)
        read = {}
        for s in res.shards:
            read.update(load_file(tmp_path / "a" / s))
        assert set(read) == set(layout.by_key) == set(read_index(tmp_path / "a"))
        for ent in layout.entries:
            assert torch.equal(read[ent.public].view(torch.uint8), ent.to_public(sd[ent.native]).view(torch.uint8))
    # native -> public -> native -> public: identical native tensors, identical files
    back = load_model(tmp_path / "a")
    for k, v in back.state_dict().items():
        assert v.dtype == sd[k].dtype and torch.equal(v.view(torch.uint8), sd[k].view(torch.uint8)), k
    save_hf(back, tmp_path / "b", max_shard_bytes=shard)
    assert files_bytes(tmp_path / "a") == files_bytes(tmp_path / "b")
    if preset == "tiny":  # state-dict mode, fp32 request: fp32 tensors exact, others upcast exactly
        sd32 = load_hf(tmp_path / "a", dtype=torch.float32)
        for k, v in sd.items():
            assert torch.equal(sd32[k], v.float()), k


def test_init_checkpoint_is_seeded(tmp_path):
    init_checkpoint("tiny", tmp_path / "a", seed=5)
    init_checkpoint("tiny", tmp_path / "b", seed=5)
    init_checkpoint("tiny", tmp_path / "c", seed=6)
    assert files_bytes(tmp_path / "a") == files_bytes(tmp_path / "b")
    assert files_bytes(tmp_path / "a") != files_bytes(tmp_path / "c")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and "quantization_config" not in cfg["text_config"]
    assert K3Config.from_json_file(tmp_path / "a" / "config.json") == K3Config.preset("tiny")


@pytest.mark.parametrize("config,check_every", [(tiny(), 1), (K3Config.preset("small").replace(num_hidden_layers=2), 5)],
                         ids=["tiny", "small-2-layers"])
def test_mxfp4_round_trip_equals_quantize_dequantize(tmp_path, config, check_every):
    """Files hold quantize(native) bit for bit; loading gives dequantize of that. (The CPU codec is
    slow, so the small preset is cut to one MoE layer and every 5th expert matrix is re-checked;
    pair placement is checked for all.)"""
    model = seeded(config, 11)
    sd = model.state_dict()
    res = save_hf(model, tmp_path / "q", target="mxfp4", max_shard_bytes=30_000)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"] == mxfp4_quantization_config()
    wm = read_index(tmp_path / "q")
    layout = public_layout(config, "mxfp4")
    pairs = [e for e in layout.entries if e.codec == "mxfp4"]
    assert pairs and len(res.shards) > 3
    back = load_hf(tmp_path / "q")
    for i, ent in enumerate(pairs):  # every pair shares a shard
        (pk, _, _), (sk, _, _) = ent.stored()
        assert wm[pk] == wm[sk]
        if i % check_every == 0:  # the pair is quantize(original); loading gives exactly its dequantisation
            with safe_open(str(tmp_path / "q" / wm[pk]), "pt") as f:
                packed, scale = f.get_tensor(pk), f.get_tensor(sk)
            qp, qs = quantize(ent.native_view(sd[ent.native]))
            assert torch.equal(packed, qp) and torch.equal(scale, qs), ent.public
            assert torch.equal(ent.native_view(back[ent.native]).view(torch.int16),
                               dequantize(qp, qs, torch.bfloat16).view(torch.int16))
    for k, v in sd.items():
        if not k.endswith(("experts.w13", "experts.w2")):
            assert torch.equal(back[k], v), k


def test_quantize_streams_to_the_same_bytes_as_save_hf(tmp_path):
    config = tiny()
    model = seeded(config, 4)
    save_hf(model, tmp_path / "bf16", max_shard_bytes=50_000)
    save_hf(model, tmp_path / "direct", target="mxfp4", max_shard_bytes=50_000)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "streamed", max_shard_bytes=50_000)
    assert files_bytes(tmp_path / "direct") == files_bytes(tmp_path / "streamed")
    with pytest.raises(ValueError, match="already quantised"):
        quantize_checkpoint(tmp_path / "streamed", tmp_path / "again")


def test_cli_init_and_quantize(tmp_path, capsys):
    import argparse
    parser = argparse.ArgumentParser(prog="k3rl")
    add_checkpoint_subcommands(parser.add_subparsers(dest="cmd"))
    run = lambda *argv: (lambda a: a.fn(a))(parser.parse_args(["checkpoint", *argv]))  # noqa: E731
    assert run("init", "--preset", "tiny", "--out", str(tmp_path / "a"), "--seed", "2", "--max-shard-bytes", "60K") == 0
    assert len(list((tmp_path / "a").glob("model-*.safetensors"))) > 2
    assert run("init", "--preset", "tiny", "--out", str(tmp_path / "m"), "--format", "mxfp4", "--seed", "2") == 0
    assert run("quantize", str(tmp_path / "a"), str(tmp_path / "q")) == 0
    assert files_bytes(tmp_path / "m") == files_bytes(tmp_path / "q")  # one 5GB shard each
    assert run("quantize", str(tmp_path / "q"), str(tmp_path / "qq")) == 2
    assert "already quantised" in capsys.readouterr().err
    assert run("init", "--preset", "nope", "--out", str(tmp_path / "n")) == 2


def test_mxfp4_refuses_widths_off_the_block(tmp_path):
    config = tiny(routed_expert_hidden_size=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        save_hf(seeded(config), tmp_path / "q", target="mxfp4")
    assert not (tmp_path / "q").exists()


def test_load_checks_dtype_and_shape_and_a_log_padding(tmp_path):
    config = tiny()
    save_hf(seeded(config), tmp_path / "a", max_shard_bytes=10**9)
    (tmp_path / "a" / MANIFEST_NAME).unlink()  # as a checkpoint from elsewhere: the format checks must refuse these
    shard = tmp_path / "a" / "model-00001-of-00001.safetensors"
    from safetensors.torch import save_file
    t = load_file(shard)
    key = P + "layers.0.mlp.down_proj.weight"
    bad = dict(t)
    bad[key] = t[key].half()
    save_file(bad, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match="down_proj.*F16.*expected torch.bfloat16"):
        load_hf(tmp_path / "a")
    bad = dict(t)
    bad[key] = t[key][:, :-1].contiguous()
    save_file(bad, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointFormatError, match="down_proj.*expected"):
        load_hf(tmp_path / "a")
    bad = dict(t)
    a = P + "layers.1.self_attn.A_log"
    bad[a] = t[a].clone()
    bad[a][-1] = 0.5
    save_file(bad, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="padding"):
        load_hf(tmp_path / "a")
    with pytest.raises(CheckpointFormatError, match="not a K3|missing|unexpected|implies"):
        load_hf(tmp_path / "a", config=tiny(num_hidden_layers=5))


def test_save_keeps_foreign_files_and_replaces_the_checkpoint(tmp_path):
    d = tmp_path / "ck"
    save_hf(seeded(tiny(), 1), d, max_shard_bytes=50_000)
    (d / "tokenizer.json").write_text("{}")
    (d / "sub").mkdir()
    (d / "sub" / "x.txt").write_text("x")
    res = save_hf(seeded(tiny(), 2), d, max_shard_bytes=10**9)  # fewer shards than before
    names = sorted(p.name for p in d.iterdir())
    assert names == sorted(["config.json", INDEX_NAME, MANIFEST_NAME, "sub", "tokenizer.json", *res.shards])
    assert (d / "sub" / "x.txt").read_text() == "x"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_replacing_without_atomic_exchange_falls_back_to_two_renames(tmp_path, monkeypatch):
    import k3core.checkpoint.files as files
    d = tmp_path / "ck"
    save_hf(seeded(tiny(), 1), d, max_shard_bytes=50_000)
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    with pytest.warns(RuntimeWarning, match="two renames"):
        save_hf(seeded(tiny(), 2), d, max_shard_bytes=50_000)
    assert load_hf(d)["lm_head.weight"].equal(seeded(tiny(), 2).state_dict()["lm_head.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


# ------------------------------------------------------------------------------- crash safety
_CHILD = textwrap.dedent("""
    import os, sys, time
    import k3core.checkpoint.hf as hf
    import k3core.checkpoint.files as files
    from k3core.checkpoint.names import materialize, meta_model
    from k3core.config import K3Config
    out, marker, where = sys.argv[1], sys.argv[2], sys.argv[3]
    real_write, real_publish = hf.write_safetensors_hashed, hf.publish_dir
    count = [0]
    def hang():
        open(marker, "w").close()
        time.sleep(600)
    def write(path, *a, **k):
        if where == "mid_shard" and count[0] == 1:
            with open(path, "wb") as f:   # a partial shard on disk, then stop
                f.write(b"partial")
                f.flush()
            hang()
        n = real_write(path, *a, **k)
        count[0] += 1
        return n
    def publish(staging, final, **k):
        if where == "before_publish":
            hang()
        return real_publish(staging, final, **k)
    hf.write_safetensors_hashed, hf.publish_dir = write, publish
    m = materialize(meta_model(K3Config.preset("tiny")))
    m.reset_parameters(99)
    hf.save_hf(m.cast(__import__("torch").bfloat16), out, max_shard_bytes=40_000)
""")


def _all_indexes_name_whole_shards(root: Path) -> int:
    n = 0
    for idx in root.rglob(INDEX_NAME):
        for shard in set(read_index(idx.parent).values()):
            read_header(idx.parent / shard)  # raises if missing or partial
        n += 1
    return n


@pytest.mark.parametrize("where", ["mid_shard", "before_publish"])
def test_killed_writer_leaves_previous_checkpoint_intact(tmp_path, where):
    d = tmp_path / "ck"
    save_hf(seeded(tiny(), 1), d, max_shard_bytes=40_000)
    before = {p.name: sha256_file(p) for p in d.iterdir()}
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(d), str(marker), where], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, f"writer exited early with {proc.returncode}"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert {p.name: sha256_file(p) for p in d.iterdir()} == before
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".ck.partial-")]
    assert len(staged) == 1  # the dead writer's staging directory, never published
    assert _all_indexes_name_whole_shards(tmp_path) == (2 if where == "before_publish" else 1)
    assert load_hf(d)["lm_head.weight"].equal(seeded(tiny(), 1).state_dict()["lm_head.weight"])
    save_hf(seeded(tiny(), 2), d, max_shard_bytes=40_000)  # the next save clears the dead staging
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ck.partial-")]
