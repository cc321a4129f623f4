"""The W4A8 rollout engine's routed experts: packed MXFP4 weights, FP8 E4M3 activations.

Owns: ``W4A8Experts`` (a drop-in for ``RoutedExperts`` in ``LatentMoE``, inference only),
``quantize_engine_model`` (swap every routed-expert stack of a model for W4A8 experts, in place),
``packed_expert_state`` (a trainer state dict -> the tensors a W4A8 engine's ``load_weights`` takes)
and ``load_w4a8_model`` (an MXFP4 public checkpoint straight into a W4A8 model). Does not own: the
arithmetic (``k3core.ops.w4a8``), the engine loop (``k3core.rollout.engine``).

A W4A8 expert stack holds only packed bytes: four persistent uint8 buffers per MoE layer,
``experts.w13_packed`` ``[E, 2I, Dl/2]``, ``experts.w13_scale`` ``[E, 2I, Dl/32]``,
``experts.w2_packed`` ``[E, Dl, I/2]``, ``experts.w2_scale`` ``[E, Dl, I/32]`` (each expert's rows are
the release's ``experts.E.w1/w3/w2.weight_packed``/``weight_scale``, stacked), about 0.53 bytes per
weight instead of 2 (bf16). The names are stable, so a weight transfer addresses them like any
other tensor: ``RolloutEngine.load_weights(packed_expert_state(trainer_state), version)``.
Before each expert matmul the activations are quantised to FP8 E4M3 (``act_granularity``
"token" or "block32"; ``None`` keeps them unquantised: a weight-only MXFP4 "W4A16" engine, used to
tell the two error sources apart).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from k3core.model.moe import LatentMoE, RoutedExperts
from k3core.ops import mxfp4
from k3core.ops.situ import situ_glu
from k3core.ops.w4a8 import ACT_GRANULARITIES, w4a8_grouped_mm

__all__ = ["W4A8Experts", "EXPERT_BUFFERS", "ROUTED_EXPERT_SUFFIXES", "quantize_engine_model",
           "packed_expert_state", "load_w4a8_model", "expert_format"]

EXPERT_BUFFERS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")
ROUTED_EXPERT_SUFFIXES = (".experts.w13", ".experts.w2")


def _check_act(act_granularity: str | None) -> None:
    if act_granularity is not None and act_granularity not in ACT_GRANULARITIES:
        raise ValueError(f"act_granularity must be one of {ACT_GRANULARITIES} or None (weight-only), got {act_granularity!r}")


class W4A8Experts(nn.Module):
    """E SiTU-GLU experts (width I, latent width Dl) from packed MXFP4 weights; rows in, rows out,
    like ``RoutedExperts.grouped_forward``. No parameters: nothing here trains."""

    def __init__(self, num_experts: int, latent_size: int, intermediate_size: int, beta: float, linear_beta: float,
                 act_granularity: str | None = "token", device: torch.device | str | None = None):
        super().__init__()
        _check_act(act_granularity)
        for name, dim in (("latent_size", latent_size), ("intermediate_size", intermediate_size)):
            if dim % mxfp4.BLOCK:
                raise ValueError(f"W4A8 experts need {name} ({dim}) to be a multiple of {mxfp4.BLOCK} (MXFP4 blocks)")
        self.num_experts, self.latent_size, self.intermediate_size = num_experts, latent_size, intermediate_size
        self.beta, self.linear_beta = beta, linear_beta
        self.act_granularity = act_granularity
        E, I, Dl, B = num_experts, intermediate_size, latent_size, mxfp4.BLOCK
        shapes = {"w13_packed": (E, 2 * I, Dl // 2), "w13_scale": (E, 2 * I, Dl // B),
                  "w2_packed": (E, Dl, I // 2), "w2_scale": (E, Dl, I // B)}
        for name in EXPERT_BUFFERS:
            self.register_buffer(name, torch.zeros(shapes[name], dtype=torch.uint8, device=device))

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: RoutedExperts, act_granularity: str | None = "token") -> W4A8Experts:
        """Quantise a ``RoutedExperts`` stack (MXFP4, the release's scale rule)."""
        w13, w2 = experts.w13.detach(), experts.w2.detach()
        out = cls(experts.num_experts, w13.shape[-1], experts.intermediate_size, experts.beta, experts.linear_beta,
                  act_granularity, device=w13.device)
        out.w13_packed, out.w13_scale = mxfp4.quantize(w13, name="experts.w13")
        out.w2_packed, out.w2_scale = mxfp4.quantize(w2, name="experts.w2")
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, latent={self.latent_size}, intermediate={self.intermediate_size}, "
                f"weights=mxfp4, activations={'fp8_e4m3/' + self.act_granularity if self.act_granularity else 'unquantised'}")

    def grouped_forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert, ``counts[e]`` rows each: x ``[n, Dl]`` -> ``[n, Dl]``, x's dtype."""
        if x_sorted.shape[0] == 0:
            return x_sorted.new_zeros(0, self.latent_size)
        g = self.act_granularity
        h = w4a8_grouped_mm(x_sorted, counts, self.w13_packed, self.w13_scale, g)
        return w4a8_grouped_mm(situ_glu(h, self.beta, self.linear_beta), counts, self.w2_packed, self.w2_scale, g)


def expert_format(model: nn.Module) -> str:
    """How a model's routed experts run: "bf16" (plain weights, any float dtype), "w4a8"
    (MXFP4 + FP8 activations) or "w4a16" (MXFP4 weights only); "none" without MoE layers."""
    for m in model.modules():
        if isinstance(m, W4A8Experts):
            return "w4a8" if m.act_granularity else "w4a16"
        if isinstance(m, RoutedExperts):
            return "bf16"
    return "none"


@torch.no_grad()
def quantize_engine_model(model: nn.Module, act_granularity: str | None = "token") -> nn.Module:
    """Replace every ``LatentMoE.experts`` (``RoutedExperts``) of ``model`` by ``W4A8Experts`` holding
    its MXFP4 codes, in place, and return the model. The float expert weights are dropped (freed once
    nothing else holds them); every other tensor is untouched. Refuses a model already quantised."""
    _check_act(act_granularity)
    for m in model.modules():
        if isinstance(m, LatentMoE):
            if not isinstance(m.experts, RoutedExperts):
                raise ValueError(f"routed experts are already {type(m.experts).__name__}: quantise a float model")
            m.experts = W4A8Experts.from_experts(m.experts, act_granularity)
    return model


@torch.no_grad()
def packed_expert_state(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float model's state dict -> the same with each ``...experts.w13``/``w2`` replaced by its MXFP4
    pair ``..._packed``/``..._scale`` (the W4A8 engine's buffer names); other tensors pass unchanged."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        if k.endswith(ROUTED_EXPERT_SUFFIXES):
            out[k + "_packed"], out[k + "_scale"] = mxfp4.quantize(v.detach(), name=k)
        else:
            out[k] = v
    return out


@torch.no_grad()
def load_w4a8_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, act_granularity: str | None = "token",
                    device: str | torch.device = "cpu"):
    """A W4A8 ``K3ForCausalLM`` from a public checkpoint. An MXFP4 checkpoint's ``weight_packed``/
    ``weight_scale`` bytes are copied into the expert buffers as they are (no float expert weight is
    ever materialised); other tensors are read as ``load_hf`` reads them (checked shape and dtype,
    ``dtype`` except where the release keeps fp32). A bf16 checkpoint is loaded and quantised."""
    from safetensors import safe_open

    from k3core.checkpoint.files import CONFIG_NAME
    from k3core.checkpoint.hf import CheckpointFormatError, check_keys, check_manifest, checkpoint_target, load_model, read_index
    from k3core.checkpoint.names import materialize, meta_model, public_layout
    from k3core.checkpoint.safetensors_file import ST_TO_DTYPE
    from k3core.config import K3Config

    path = Path(path)
    config = K3Config.from_json_file(path / CONFIG_NAME)
    if checkpoint_target(config) != "mxfp4":
        return quantize_engine_model(load_model(path, device, dtype), act_granularity)
    model = meta_model(config)
    for m in model.modules():
        if isinstance(m, LatentMoE):
            ex = m.experts
            m.experts = W4A8Experts(ex.num_experts, ex.w13.shape[-1], ex.intermediate_size, ex.beta, ex.linear_beta,
                                    act_granularity, device="meta")
    materialize(model, device)
    model.cast(dtype)
    layout = public_layout(config, "mxfp4")
    weight_map = read_index(path)
    check_keys(layout, weight_map)
    check_manifest(path, weight_map)  # before a tensor is read: a file changed since it was written is refused
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    handles = {}
    try:
        for ent in layout.entries:
            for j, (key, shape, dt) in enumerate(ent.stored()):
                shard = weight_map[key]
                if shard not in handles:
                    handles[shard] = safe_open(str(path / shard), framework="pt", device="cpu")
                sl = handles[shard].get_slice(key)
                got = (ST_TO_DTYPE.get(sl.get_dtype()), tuple(sl.get_shape()))
                if got != (dt, shape):
                    raise CheckpointFormatError(f"{key!r} in {shard}: {got[0]} {list(got[1])}, expected {dt} {list(shape)}")
                t = handles[shard].get_tensor(key)
                if ent.codec == "mxfp4":  # j = 0: weight_packed, j = 1: weight_scale
                    dst = own[ent.native + ("_packed", "_scale")[j]]
                    view = dst[ent.expert] if ent.rows is None else dst[ent.expert][ent.rows[0]:ent.rows[1]]
                    view.copy_(t)
                else:
                    view = ent.native_view(own[ent.native])
                    view.copy_(ent.narrow_public(t).to(view.dtype))
    finally:
        handles.clear()
    return model
