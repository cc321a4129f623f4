"""The fla kernel configs k3rl ships (``k3core/ops/kda/fla_configs``) and how k3core points fla at them.

CPU: shipped files are fla 0.6 config files (an entry's name is the md5 of its compact, key-sorted
JSON autotune key, as ``fla/ops/utils/cache.py`` looks them up) holding the head shape of every
call their manifest says finished; ``fla_tune.merge`` orders entries and resumes without losing
any; ``point_fla_at_shipped_configs`` sets only what the user left unset. GPU: with the shipped
configs active, the calls they cover run without a single fla autotuning.
"""

import hashlib
import importlib.metadata
import json
import os
import sys
import types

import pytest
import torch

from k3core.ops.kda import _fla
from k3core.ops.kda.fla_tune import (autotuned_kernels, call_groups, fla_autotuners, import_triton_autotune, merge,
                                     run_call)

SHIPPED = sorted(p for p in _fla.SHIPPED_CONFIGS.glob("*/*") if p.is_dir())


def _config_files():
    return [f for d in SHIPPED for f in sorted(d.glob("*.json")) if f.name != "MANIFEST.json"]


def _check_fla_format(path):
    data = json.loads(path.read_text())
    assert data["kernel_name"] == path.stem
    assert data["autotune_entries"]
    for digest, entry in data["autotune_entries"].items():
        key = json.dumps(entry["autotune_key"], separators=(",", ":"), sort_keys=True)
        assert hashlib.md5(key.encode()).hexdigest() == digest
        cfg = entry["config"]
        assert isinstance(cfg["kwargs"], dict)
        assert all(isinstance(cfg[n], int) for n in ("num_warps", "num_stages", "num_ctas"))


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_config_file_is_in_fla_format(path):
    _check_fla_format(path)


@pytest.mark.parametrize("gpu_dir", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_finished_call_has_its_head_shape_shipped(gpu_dir):
    """The manifest names the fla version and GPU of its directory, and every call it lists as
    finished (decode aside: fla's fused recurrent kernel has no autotuner) has its (H, K) in the
    recurrent-state kernel's entries, keyed (H, HV, K, V, ...)."""
    manifest = json.loads((gpu_dir / "MANIFEST.json").read_text())
    assert manifest["versions"]["fla_core"] == gpu_dir.parent.name and manifest["versions"]["gpu"] == gpu_dir.name
    data = json.loads((gpu_dir / "chunk_gated_delta_rule_fwd_kernel_h_blockdim64.json").read_text())
    shapes = {(e["autotune_key"][0], e["autotune_key"][2]) for e in data["autotune_entries"].values()}
    calls = {c["name"]: c for group in manifest["calls"].values() for c in group}
    for names in manifest["calls_done"].values():
        for name in names:
            if not calls[name]["decode"]:
                assert (calls[name]["heads"], calls[name]["head_dim"]) in shapes, name


def _dump(path, group, done, entries, versions=None):
    path.write_text(json.dumps({"group": group, "calls_done": done, "versions": versions or VERSIONS,
                                "kernels": entries, "plain_triton_autotune": {}, "unserialisable_keys": []}))
    return path


VERSIONS = {"fla_core": "0.6.0", "triton": "3.6.0", "torch": "2.11", "gpu": "NVIDIA_H200", "gpu_name": "NVIDIA H200"}


def _entry(key, warps):
    digest = hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()
    return digest, {"autotune_key": key, "config": {"kwargs": {"BV": 32}, "num_warps": warps, "num_stages": 2,
                                                     "num_ctas": 1, "maxnreg": None, "ir_override": None}}


def test_merge_writes_fla_files_largest_key_first_and_keeps_what_a_resumed_run_lacks(tmp_path):
    groups = {g: c for g, c in call_groups().items() if g in ("small-bf16", "full-bf16")}
    small, full, tiny = _entry([4, 4, 64, 64, 64, "torch.bfloat16"], 4), _entry([96, 96, 128, 128, 64, "torch.bfloat16"], 8), \
        _entry([2, 2, 16, 16, 64, "torch.bfloat16"], 2)
    out = tmp_path / "out"
    d1 = _dump(tmp_path / "a.json", "small-bf16", ["small-bf16-train"], {"k_fwd": dict([small])})
    d2 = _dump(tmp_path / "b.json", "full-bf16", [], {"k_fwd": dict([full])})  # killed mid-call: partial
    m = merge([d1, d2], out, groups, {"small-bf16": "rc=0 after 1 s", "full-bf16": "killed"}, keep=False)
    data = json.loads((out / "k_fwd.json").read_text())
    assert list(data["autotune_entries"]) == [full[0], small[0]]  # fuzzy lookups meet the largest first
    _check_fla_format(out / "k_fwd.json")
    assert m["calls_not_done"]["full-bf16"] == ["full-bf16-train", "full-bf16-prefill", "full-bf16-decode"]
    assert m["calls_not_done"]["small-bf16"] == ["small-bf16-prefill", "small-bf16-decode"]
    # resume: a later run adds the tiny entry and finishes full-bf16-train; nothing is lost
    d3 = _dump(tmp_path / "c.json", "full-bf16", ["full-bf16-train"], {"k_fwd": dict([full, tiny]), "k_bwd": dict([tiny])})
    m = merge([d3], out, {"full-bf16": groups["full-bf16"]}, {"full-bf16": "rc=0"}, keep=True)
    data = json.loads((out / "k_fwd.json").read_text())
    assert list(data["autotune_entries"]) == [full[0], small[0], tiny[0]]
    assert (out / "k_bwd.json").exists() and m["calls_done"]["small-bf16"] == ["small-bf16-train"]
    assert m["calls_not_done"]["full-bf16"] == ["full-bf16-prefill", "full-bf16-decode"]
    with pytest.raises(SystemExit, match="holds configs of"):  # never mix fla/triton/GPU versions in one dir
        merge([_dump(tmp_path / "d.json", "full-bf16", [], {}, {**VERSIONS, "triton": "3.7.0"})], out, groups, {}, keep=True)


def test_import_triton_autotune_takes_each_keys_least_median_config(tmp_path):
    """Triton's disk cache (TRITON_CACHE_AUTOTUNING=1) holds every config's (median, p20, p80) per
    key; the import keeps the least median, as Triton's own choice does, under fla's hash."""
    def cfg(bv, warps):
        return {"kwargs": {"BV": bv}, "num_warps": warps, "num_ctas": 1, "num_stages": 2, "maxnreg": None,
                "pre_hook": None, "ir_override": None}

    key = [4, 4, 64, 64, 64, False, "torch.float32"]
    src = tmp_path / "cache"
    for i, timings in enumerate([[(cfg(32, 4), [2.0, 1.0, 3.0]), (cfg(64, 8), [1.5, 1.4, 9.0])],
                                 [(cfg(16, 2), [1.6, 0.1, 1.7])]]):  # the same key cached twice
        (src / f"h{i}").mkdir(parents=True)
        (src / f"h{i}" / "k_fwd.autotune.json").write_text(json.dumps({"key": key, "configs_timings": timings}))
    out = tmp_path / "0.6.0" / "NVIDIA_H200"
    m = import_triton_autotune(src, out, "3.6.0")
    _check_fla_format(out / "k_fwd.json")
    (entry,) = json.loads((out / "k_fwd.json").read_text())["autotune_entries"].values()
    assert entry["autotune_key"] == key and entry["config"]["kwargs"] == {"BV": 64} and entry["config"]["num_warps"] == 8
    assert m["versions"] == {"fla_core": "0.6.0", "triton": "3.6.0", "gpu": "NVIDIA_H200"}
    assert m["imported_from"] == ["cache"] and m["calls_done"] == {}


@pytest.fixture
def fresh_env(monkeypatch, tmp_path):
    """No FLA_* variables, fla's cache module not imported, and a shipped directory at tmp_path."""
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.delitem(sys.modules, "fla.ops.utils.cache", raising=False)
    monkeypatch.setattr(_fla, "shipped_config_dir", lambda: tmp_path)
    return tmp_path


def test_point_fla_sets_both_variables_when_unset(fresh_env):
    assert _fla.point_fla_at_shipped_configs() == {"FLA_CACHE_MODE": "strict", "FLA_CONFIG_DIR": str(fresh_env)}
    assert os.environ["FLA_CACHE_MODE"] == "strict" and os.environ["FLA_CONFIG_DIR"] == str(fresh_env)


@pytest.mark.parametrize("user", [{"FLA_CACHE_MODE": "strict"}, {"FLA_CONFIG_DIR": "/mine"},
                                  {"FLA_CACHE_MODE": "disabled", "FLA_CONFIG_DIR": "/mine"}])
def test_a_users_setting_wins(fresh_env, monkeypatch, user):
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    set_now = _fla.point_fla_at_shipped_configs()
    assert not set(set_now) & set(user)
    for name, value in user.items():
        assert os.environ[name] == value


def test_nothing_is_set_without_a_directory_or_once_fla_read_its_mode(fresh_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", object())
    assert _fla.point_fla_at_shipped_configs() == {}
    monkeypatch.delitem(sys.modules, "fla.ops.utils.cache")
    monkeypatch.setattr(_fla, "shipped_config_dir", lambda: None)
    assert _fla.point_fla_at_shipped_configs() == {}
    assert "FLA_CACHE_MODE" not in os.environ and "FLA_CONFIG_DIR" not in os.environ


H200_ARCH = {"capability": "9.0", "smem_per_block_optin": 232448, "multi_processor_count": 132}


@pytest.mark.parametrize("gpu,arch,version,recorded,found", [
    ("NVIDIA H200", (9, 0, 232448, 132), "0.6.0", True, True),
    # same sm_90 and shared memory: the H200's configs launch (an H100 SXM; PCIe has fewer SMs)
    ("NVIDIA H100 80GB HBM3", (9, 0, 232448, 132), "0.6.0", True, True),
    ("NVIDIA H100 PCIe", (9, 0, 232448, 114), "0.6.0", True, True),
    ("NVIDIA H100 80GB HBM3", (9, 0, 232448, 132), "0.6.0", False, False),  # H200's arch unrecorded
    ("NVIDIA A100-SXM4-80GB", (8, 0, 166912, 108), "0.6.0", True, False),  # other ISA, less shared memory
    ("Hypothetical sm90", (9, 0, 101376, 132), "0.6.0", True, False),  # H200 tiles would not fit
    ("NVIDIA H200", (9, 0, 232448, 132), "0.7.0", True, False),  # another fla: its kernels' arguments may differ
])
def test_shipped_config_dir_matches_fla_version_and_gpu(monkeypatch, tmp_path, gpu, arch, version, recorded, found):
    h200 = tmp_path / "0.6.0" / "NVIDIA_H200"
    h200.mkdir(parents=True)
    (h200 / "MANIFEST.json").write_text(json.dumps({"versions": {"gpu": "NVIDIA_H200", **({"arch": H200_ARCH} if recorded else {})}}))
    major, minor, smem, sms = arch
    props = types.SimpleNamespace(major=major, minor=minor, shared_memory_per_block_optin=smem, multi_processor_count=sms)
    monkeypatch.setattr(_fla, "SHIPPED_CONFIGS", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    assert _fla.shipped_config_dir() == (h200 if found else None)


def test_the_shipped_h200_manifest_records_its_arch():
    """The fallback reads ``versions.arch`` from the shipped MANIFEST: without it no other GPU reads these configs."""
    manifest = json.loads((_fla.SHIPPED_CONFIGS / "0.6.0" / "NVIDIA_H200" / "MANIFEST.json").read_text())
    assert manifest["versions"]["arch"] == H200_ARCH


# ----------------------------------------------------------------------------- GPU

# one call of each kind: prefill and training of two presets, packed with state at a training
# shape, and the GPU tests' raw-gate fp32 and general-gate bf16 calls
GPU_CALLS = ("full-bf16-train", "full-bf16-prefill", "small-bf16-train", "small-bf16-prefill", "tiny-fp32-train", "medium-bf16-packed-state",
             "test-fp32-raw-packed", "test-bf16-general-fixed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_shipped_configs_mean_no_fla_autotuning():
    assert _fla.available(), "fla must import on the GPU machine"
    shipped = _fla.shipped_config_dir()
    if shipped is None or os.environ.get("FLA_CONFIG_DIR") != str(shipped):
        pytest.skip(f"shipped configs not active here (dir {shipped}, FLA_CONFIG_DIR "
                    f"{os.environ.get('FLA_CONFIG_DIR')}, FLA_CACHE_MODE {os.environ.get('FLA_CACHE_MODE')})")
    from fla.ops.utils.cache import CachedAutotuner

    done = {n for names in json.loads((shipped / "MANIFEST.json").read_text())["calls_done"].values() for n in names}
    if not set(GPU_CALLS) & done:
        pytest.skip(f"none of {GPU_CALLS} is tuned in {shipped} yet")
    calls = {c.name: c for group in call_groups().values() for c in group}
    for name in (n for n in GPU_CALLS if n in done):
        before = {id(t): id(getattr(t, "configs_timings", None)) for t in fla_autotuners()}
        run_call(calls[name])
        tuned = [t.kernel_name for t in fla_autotuners() if isinstance(t, CachedAutotuner)
                 and id(getattr(t, "configs_timings", None)) != before.get(id(t), id(None))]
        assert not tuned, f"{name}: fla autotuned {tuned} (all tuned so far: {autotuned_kernels()})"


def _cfg(bk, warps, stages):
    from types import SimpleNamespace

    return SimpleNamespace(kwargs={"BK": bk}, num_warps=warps, num_stages=stages)


def test_pick_candidates_takes_prior_winners_then_spans_fla_list():
    """``fla_tune --max-configs``: at most n candidates, a config that already won on this GPU
    first (at most half of n), the rest spread over fla's list from its first to its last entry."""
    from k3core.ops.kda.fla_tune import pick_candidates

    configs = [_cfg(bk, w, s) for bk in (32, 64) for w in (2, 4, 8) for s in (2, 3, 4)]  # 18, fla's order
    prior = [{"kwargs": {"BK": 64}, "num_warps": 4, "num_stages": 3},
             {"kwargs": {"BK": 32}, "num_warps": 2, "num_stages": 3},
             {"kwargs": {"BK": 128}, "num_warps": 4, "num_stages": 3}]  # not in the list: ignored
    picked = pick_candidates(configs, prior, 4)
    keys = [(c.kwargs["BK"], c.num_warps, c.num_stages) for c in picked]
    assert len(picked) == 4 and len(set(keys)) == 4
    assert (64, 4, 3) in keys and (32, 2, 3) in keys  # both priors fit in n // 2
    assert (32, 2, 2) in keys and (64, 8, 4) in keys  # both ends of the list
    assert [configs.index(c) for c in picked] == sorted(configs.index(c) for c in picked)  # fla's order kept
    assert pick_candidates(configs, [], 2) == [configs[0], configs[-1]]
    assert pick_candidates(configs[:3], prior, 4) == configs[:3]  # short lists untouched
    many_priors = [{"kwargs": {"BK": b}, "num_warps": w, "num_stages": 2} for b in (32, 64) for w in (2, 4, 8)]
    assert sum((c.kwargs["BK"], c.num_warps, 2) in {(p["kwargs"]["BK"], p["num_warps"], 2) for p in many_priors}
               and c.num_stages == 2 for c in pick_candidates(configs, many_priors, 4)) >= 2


def test_shipped_winners_reads_each_kernels_configs_most_frequent_first(tmp_path):
    from k3core.ops.kda.fla_tune import shipped_winners

    entries = dict([_entry([4, 4, 64, 64, 64], 4), _entry([4, 4, 128, 128, 64], 4), _entry([2, 2, 16, 16, 64], 8)])
    (tmp_path / "k.json").write_text(json.dumps({"kernel_name": "k", "autotune_entries": entries}))
    (tmp_path / "MANIFEST.json").write_text("{}")
    got = shipped_winners(tmp_path)
    assert list(got) == ["k"] and [c["num_warps"] for c in got["k"]] == [4, 8]
    assert shipped_winners(tmp_path / "absent") == {}


def test_head_count_match_frees_only_head_and_batch_counts():
    """k3core's fallback after fla's exact lookup: an entry may differ from the call's key in B, H
    or HV (grid sizes) only; a different head dim, tile size, flag or dtype is no match."""
    names = ["H", "HV", "K", "V", "BT", "IS_VARLEN"]
    key = [12, 12, 128, 128, 64, False, "torch.bfloat16", "torch.float32"]
    tuned_full = [96, 96, 128, 128, 64, False, "torch.bfloat16", "torch.float32"]
    other_dim = [12, 12, 64, 64, 64, False, "torch.bfloat16", "torch.float32"]
    other_dtype = [96, 96, 128, 128, 64, False, "torch.float32", "torch.float32"]
    packed = [96, 96, 128, 128, 64, True, "torch.bfloat16", "torch.float32"]
    assert _fla.head_count_match([other_dim, other_dtype, packed, tuned_full], names, key) == tuned_full
    assert _fla.head_count_match([other_dim, other_dtype, packed], names, key) is None
    assert _fla.head_count_match([tuned_full[:-1]], names, key) is None  # another structure
    # a count name past the named positions (a dtype slot) is never freed
    assert _fla.head_count_match([[12, "torch.float32"]], ["H"], [12, "torch.bfloat16"]) is None
    assert _fla.head_count_match([[4, 2, 64, "torch.float32"]], ["B", "H", "BT"], [1, 96, 64, "torch.float32"]) == [4, 2, 64, "torch.float32"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_medium_training_call_takes_the_full_models_configs_without_autotuning():
    """medium's KDA (H=12, K=V=128, B=2) differs from the tuned full-model call (H=96, B=1) only in
    head and batch counts: k3core's fallback hands it the full model's configs, so nothing autotunes."""
    assert _fla.available(), "fla must import on the GPU machine"
    shipped = _fla.shipped_config_dir()
    if shipped is None or os.environ.get("FLA_CONFIG_DIR") != str(shipped):
        pytest.skip("shipped configs not active here")
    from fla.ops.utils.cache import CachedAutotuner

    calls = {c.name: c for group in call_groups().values() for c in group}
    before = {id(t): id(getattr(t, "configs_timings", None)) for t in fla_autotuners()}
    run_call(calls["medium-bf16-train"])
    tuned = [t.kernel_name for t in fla_autotuners() if isinstance(t, CachedAutotuner)
             and id(getattr(t, "configs_timings", None)) != before.get(id(t), id(None))]
    assert not tuned, f"medium-bf16-train autotuned {tuned}"
