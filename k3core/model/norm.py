"""RMSNorm, computed in fp32: ``weight * x / sqrt(mean(x^2) + eps)``, returned in the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from k3core.ops.compiled import compiled, use_compiled
from k3core.ops.norms import use_fused


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 for bf16/fp16/fp32 inputs, fp64 stays fp64 (so fp64 reference checks stay exact)."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x ``[..., D]``, weight ``[D]`` or None (no scale). fp32 inside, x's dtype out. Inference on
    CUDA runs it as one kernel (``k3core.ops.norms``), the trainer on CUDA as its torch.compile'd form
    (``k3core.ops.compiled``); ``rms_norm_reference`` is the reference of both."""
    if use_fused(x, weight):
        from k3core.ops.norms.fused_triton import rms_norm as fused

        return fused(x, weight, eps)
    if use_compiled(x):
        return compiled(rms_norm_reference)(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in plain torch ops."""
    xf = at_least_fp32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """Public name: ``<name>.weight`` of shape ``[dim]``."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
