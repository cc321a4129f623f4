"""Rollout engines and their weight updates from public-layout checkpoints (bf16 or MXFP4).

Owns: ``engine_from_checkpoint`` (a checkpoint directory -> a ``RolloutEngine``, W4A8 for an MXFP4
checkpoint unless told otherwise) and ``checkpoint_state_for`` (a checkpoint directory -> the state
dict an existing engine's ``load_weights`` takes: what ``update_weights_from_disk`` loads, over HTTP
in ``server.py`` or in process in ``client.py``). Does not own: the checkpoint format
(``k3core.checkpoint``), the digest checks of a published weight version (``k3core.transfer``), the
engine (``engine.py``).

torch and the checkpoint code are imported where used, so the server's command line can name
``DTYPES`` and ``EXPERTS`` without loading them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3core.rollout.engine import RolloutEngine

__all__ = ["DTYPES", "EXPERTS", "engine_from_checkpoint", "checkpoint_state_for"]

DTYPES = ("float32", "bfloat16", "float16")
EXPERTS = ("auto", "float")


def _torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def engine_from_checkpoint(path: str | Path, dtype: str = "float32", experts: str = "auto", weight_version: int = 0,
                           max_batch: int = 256, max_queue: int = 4096) -> RolloutEngine:
    """An engine over the public-layout checkpoint at ``path``. ``experts`` "auto": an MXFP4
    checkpoint runs the W4A8 engine (packed expert bytes as stored, FP8 activations: the pipeline's
    rollout path), a bf16 one a float engine; "float": MXFP4 pairs are dequantised on load."""
    from k3core.checkpoint.files import CONFIG_NAME
    from k3core.checkpoint.hf import checkpoint_target, load_model
    from k3core.config import K3Config
    from k3core.rollout.engine import RolloutEngine

    if experts not in EXPERTS:
        raise ValueError(f"experts must be one of {EXPERTS}, got {experts!r}")
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME}: not a checkpoint directory in the public layout")
    config = K3Config.from_json_file(path / CONFIG_NAME)
    if experts == "auto" and checkpoint_target(config) == "mxfp4":
        from k3core.rollout.quantized import load_w4a8_model

        model = load_w4a8_model(path, _torch_dtype(dtype))
    else:
        model = load_model(path, dtype=_torch_dtype(dtype))
    return RolloutEngine(model, weight_version, max_batch=max_batch, max_queue=max_queue)


def checkpoint_state_for(engine: RolloutEngine, path: str | Path) -> tuple[dict, int | None]:
    """(the state dict ``engine.load_weights`` takes, the version the directory declares or None),
    read from the public checkpoint at ``path``, shapes and dtypes checked against the engine's config
    while reading. A directory published by ``k3core.transfer.write_disk`` (``weight_version.json``
    beside it) goes through ``read_disk``: every stored tensor's digest is checked first. A W4A8
    engine gets packed expert bytes (as stored in an MXFP4 checkpoint, quantised from a bf16 one); a
    float engine gets native tensors (MXFP4 pairs dequantised) in its own dtype (``load_hf``)."""
    from k3core.checkpoint.files import CONFIG_NAME
    from k3core.checkpoint.hf import checkpoint_target, load_hf
    from k3core.config import K3Config
    from k3core.rollout.quantized import W4A8Experts, expert_format, load_w4a8_model, packed_expert_state
    from k3core.transfer import VERSION_FILE, read_disk

    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME} (model_path must be a checkpoint directory in the public layout)")
    _check_same_architecture(engine, path)
    dtype = engine.model.lm_head.weight.dtype
    packed = expert_format(engine.model) in ("w4a8", "w4a16")
    mxfp4 = checkpoint_target(K3Config.from_json_file(path / CONFIG_NAME)) == "mxfp4"
    if (path / VERSION_FILE).is_file():
        state, version = read_disk(path, packed_experts=packed and mxfp4, dtype=dtype)
        return (packed_expert_state(state) if packed and not mxfp4 else state), version
    if packed:
        act = next(m.act_granularity for m in engine.model.modules() if isinstance(m, W4A8Experts))
        if mxfp4:
            return load_w4a8_model(path, dtype, act).state_dict(), None
        return packed_expert_state(load_hf(path, config=engine.config, dtype=dtype)), None
    return load_hf(path, config=engine.config, dtype=dtype), None


def _check_same_architecture(engine: RolloutEngine, path: Path) -> None:
    from k3core.checkpoint.files import CONFIG_NAME
    from k3core.config import K3Config

    theirs = K3Config.from_json_file(path / CONFIG_NAME).replace(quantization_config=None).to_hf_dict()
    ours = engine.config.replace(quantization_config=None).to_hf_dict()
    if theirs != ours:
        diff = sorted(k for k in set(theirs["text_config"]) | set(ours["text_config"])
                      if theirs["text_config"].get(k) != ours["text_config"].get(k))
        raise ValueError(f"{path} holds another architecture than the one served (differs in {diff[:5]})")
