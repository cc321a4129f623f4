"""The policy's weights as the trainer holds them (public-layout checkpoints) and as a rollout engine
holds them (float, or W4A8 with packed MXFP4 routed experts): loading, building an engine, and the
tensors a weight transfer sends."""

from __future__ import annotations

from pathlib import Path

import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rollout.engine import RolloutEngine

ROUTED_EXPERT_SUFFIXES = (".experts.w13", ".experts.w2")


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> K3ForCausalLM:
    """A public-layout checkpoint as the trainer's model, materialised on ``device``."""
    from k3core.checkpoint.hf import load_model

    return load_model(path, device=device, dtype=dtype)


def mxfp4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """What an MXFP4 engine holds for a routed-expert weight: dequantize(quantize(w))."""
    from k3core.ops.mxfp4 import dequantize, quantize

    packed, scale = quantize(w.detach())
    return dequantize(packed, scale, dtype=w.dtype)


def engine_state(model: K3ForCausalLM, quantize_experts: bool, w4a8: bool = True) -> dict[str, torch.Tensor]:
    """The tensors a transfer sends: every parameter and persistent buffer of ``model``.

    ``quantize_experts`` (the engine runs MXFP4 routed experts): with ``w4a8`` (the default rollout
    path) each ``experts.w13``/``w2`` goes as its MXFP4 pair ``..._packed``/``..._scale``, the W4A8
    engine's buffers (``k3core.rollout.quantized``), 0.53 bytes per weight on the wire; with
    ``w4a8=False`` as its dequantised round trip under the float names (a float engine running
    MXFP4 weights, activations unquantised)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if not quantize_experts:
        return sd
    if w4a8:
        from k3core.rollout.quantized import packed_expert_state

        return packed_expert_state(sd)
    return {k: mxfp4_roundtrip(v) if k.endswith(ROUTED_EXPERT_SUFFIXES) else v for k, v in sd.items()}


def engine_from_model(model: K3ForCausalLM, weight_version: int, quantized: bool,
                      act_granularity: str | None = "token", decode: str = "dynamic") -> RolloutEngine:
    """An engine around ``model`` (taken over: with ``quantized`` its routed experts are swapped for
    W4A8 experts in place, on the model's device, and the float expert weights dropped). A later
    transfer into it takes ``engine_state(trainer, quantize_experts=quantized)``. ``decode``: the
    engine's decode mode, resolved (``k3core.device.decode_mode`` resolves a run's ``--decode``)."""
    if quantized:
        from k3core.rollout.quantized import quantize_engine_model

        quantize_engine_model(model, act_granularity)
    return RolloutEngine(model, weight_version, decode=decode)


def build_engine(weights_path: str | Path, weight_version: int, dtype: torch.dtype = torch.float32,
                 w4a8: bool = True, device: str | torch.device = "cpu", decode: str = "dynamic") -> RolloutEngine:
    """An engine on ``device`` from a public-layout checkpoint. An MXFP4 checkpoint gives the W4A8
    engine (packed expert bytes loaded as they are, FP8 activations; ``w4a8=False``: experts
    dequantised on load, activations unquantised); a bf16 checkpoint gives a float engine.
    ``decode``: the engine's decode mode, resolved (``k3core.device.decode_mode``)."""
    from k3core.checkpoint.files import CONFIG_NAME
    from k3core.checkpoint.hf import checkpoint_target

    config = K3Config.from_json_file(Path(weights_path) / CONFIG_NAME)
    if w4a8 and checkpoint_target(config) == "mxfp4":
        from k3core.rollout.quantized import load_w4a8_model

        return RolloutEngine(load_w4a8_model(weights_path, dtype, device=device), weight_version, decode=decode)
    return RolloutEngine(load_policy(weights_path, dtype, device), weight_version, decode=decode)
