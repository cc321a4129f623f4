"""The one fix k3rl applies to a real SGLang server: refresh the AttnRes ``w * gamma`` cache after every
weight update (``attn-res-cw-refresh``).

Owns: ``refresh_attn_res_cw_caches(model)`` and its registration as an SGLang plugin hook.
Does not own: launching SGLang (``k3core.rollout.sglang_serving.launch_command``), anything else of SGLang.

Why: SGLang's K3 caches the product of each AttnRes site's norm and projection weights on the
projection module (``get_cw`` in ``sglang/srt/layers/attn_residual.py``) and warms it after loading.
A later ``/update_weights_from_disk`` (or from tensor, IPC or distributed) writes new weights but
``get_cw`` returns the cached product of the old ones, so the served model mixes its residual
stream with stale scores. The fix recomputes every cached product after each update, through SGLang's
own ``get_cw``, and copies it into the cached tensor in place: CUDA graphs captured at start read that
storage, so a new tensor would not reach them.

How it reaches SGLang's worker processes: SGLang loads the entry points of group
``sglang.srt.plugins`` in every process it starts (``sglang.srt.plugins.load_plugins``); k3rl declares
``register`` there (pyproject.toml). It acts only when ``K3RL_SGLANG_FIXES`` names the fix, which
``k3rl sglang-server`` sets, so an SGLang started by other means in the same environment is unchanged.
"""

from __future__ import annotations

import os

FIX_NAME = "attn-res-cw-refresh"
ENV = "K3RL_SGLANG_FIXES"

# Every WeightUpdater method that writes weights into a running model.
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
HOOKED = tuple(f"{_UPDATER}.{m}" for m in ("update_weights_from_disk", "update_weights_from_tensor",
                                           "update_weights_from_ipc", "load_weights_from_distributed",
                                           "end_weight_update"))


def _attn_res_sites(model):
    """(projection, norm) pairs of every AttnRes site: SGLang's K3 names them ``<site>_res_proj`` and
    ``<site>_res_norm`` on the same module (decoder layers, and the model's output site)."""
    for module in model.modules():
        for name, child in module.named_children():
            if name.endswith("_res_proj"):
                norm = getattr(module, name[: -len("_proj")] + "_norm", None)
                if norm is not None:
                    yield child, norm


def refresh_attn_res_cw_caches(model) -> int:
    """Recompute every cached ``w * gamma`` of ``model`` with SGLang's ``get_cw`` and write it into the
    cached tensor in place. Returns how many cached tensors were refreshed."""
    from sglang.srt.layers.attn_residual import get_cw

    refreshed = 0
    for proj, norm in _attn_res_sites(model):
        cache = getattr(proj, "_attn_res_cw_cache", None)
        if not cache:
            continue
        proj._attn_res_cw_cache = {}  # get_cw computes afresh into an empty cache
        try:
            for dtype, cached in cache.items():
                cached.copy_(get_cw(proj, norm, dtype))
                refreshed += 1
        finally:
            proj._attn_res_cw_cache = cache
    return refreshed


def _after_update(result, updater, *args, **kwargs):
    model = updater.get_model()
    if model is not None:
        refresh_attn_res_cw_caches(model)
    return result


def enabled() -> bool:
    return FIX_NAME in {s.strip() for s in os.environ.get(ENV, "").split(",")}


def register(force: bool = False) -> bool:
    """SGLang plugin entry point: hook ``refresh_attn_res_cw_caches`` after every weight update (when
    ``K3RL_SGLANG_FIXES`` names the fix, or ``force``). Returns whether the hooks were registered; SGLang's
    ``load_plugins`` applies them (``HookRegistry.apply_hooks``)."""
    if not (force or enabled()):
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in HOOKED:
        HookRegistry.register(target, _after_update, HookType.AFTER)
    return True
