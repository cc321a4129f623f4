"""The ``attn-res-cw-refresh`` fix (k3core.rollout.sglang_fix) on SGLang's own code: a K3 model built and
loaded by SGLang, updated through SGLang's ``WeightUpdater.update_weights_from_disk`` (the path behind
``/update_weights_from_disk``), read through SGLang's ``get_cw``. Without the fix the cached product
still holds the old weights; with it, the new ones, in the same tensor (CUDA graphs keep its address)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import sglang_cpu
from k3core.checkpoint.hf import init_checkpoint
from k3core.rollout import sglang_fix


def _with_new_attn_res_weights(src, dst, seed):
    """A copy of checkpoint ``src`` whose AttnRes projection and norm weights are new random values
    (a fresh k3rl model has zero projections, which would hide a stale cache)."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if "_res_proj." in name or "_res_norm." in name:
                tensors[name] = (torch.randn(t.shape, generator=g) + (1.0 if "_res_norm." in name else 0.0)).to(t.dtype)
        save_file(tensors, shard, metadata={"format": "pt"})
    return dst


@pytest.fixture
def loaded(tmp_path):
    base = tmp_path / "base"
    init_checkpoint("tiny", base)
    a = _with_new_attn_res_weights(base, tmp_path / "a", 1)
    b = _with_new_attn_res_weights(base, tmp_path / "b", 2)
    model, mc = sglang_cpu.build_sglang_k3(str(a))
    tensors = {}
    for shard in sorted(a.glob("*.safetensors")):
        tensors.update(load_file(shard))
    model.load_weights(list(tensors.items()))  # SGLang's load, then its post_load_weights warms get_cw

    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=mc, custom_weight_loaders={},
                            get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)
    return model, updater, b


def _sites(model):
    return list(sglang_fix._attn_res_sites(model))


def _stale(model):
    """AttnRes sites whose cached w*gamma (SGLang's get_cw) differs from the product of the loaded weights."""
    from sglang.srt.layers.attn_residual import get_cw

    return [i for i, (proj, norm) in enumerate(_sites(model))
            if not torch.equal(get_cw(proj, norm), norm.weight.float() * proj.weight.squeeze().float())]


def test_sglang_keeps_a_stale_attn_res_cache_without_the_fix(loaded):
    model, updater, b = loaded
    n_sites = len(_sites(model))
    assert n_sites == 2 * 4 + 1  # two per decoder layer of tiny, one output site
    assert _stale(model) == []
    ok, message = updater.update_weights_from_disk(str(b), "auto")
    assert ok, message
    assert len(_stale(model)) == n_sites


def test_the_fix_refreshes_the_cache_in_place_after_an_update(loaded, monkeypatch):
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target in sglang_fix.HOOKED:  # restore SGLang's methods after the test
        attr = target.rsplit(".", 1)[1]
        monkeypatch.setattr(WeightUpdater, attr, getattr(WeightUpdater, attr))
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())

    assert not sglang_fix.register()  # the launcher's environment variable is not set
    monkeypatch.setenv(sglang_fix.ENV, sglang_fix.FIX_NAME)
    assert sglang_fix.register()
    HookRegistry.apply_hooks()  # what SGLang's load_plugins does in each of its processes

    model, updater, b = loaded
    cached = [proj._attn_res_cw_cache[torch.float32] for proj, _ in _sites(model)]
    ok, message = updater.update_weights_from_disk(str(b), "auto")
    assert ok, message
    assert _stale(model) == []
    after = [proj._attn_res_cw_cache[torch.float32] for proj, _ in _sites(model)]
    assert all(x is y for x, y in zip(cached, after))  # same tensors: captured CUDA graphs see the update

    # the tensor path (/update_weights_from_tensor) with only the AttnRes weights changed
    g = torch.Generator().manual_seed(3)
    named = [(n, torch.randn(p.shape, generator=g).to(p.dtype)) for n, p in model.named_parameters()
             if "_res_proj." in n or "_res_norm." in n]
    before = [proj.weight.detach().clone() for proj, _ in _sites(model)]
    ok, message = updater.update_weights_from_tensor(named)
    assert ok, message
    assert not any(torch.equal(b, proj.weight) for b, (proj, _) in zip(before, _sites(model)))
    assert _stale(model) == []
