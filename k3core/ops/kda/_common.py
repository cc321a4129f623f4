"""Small helpers shared by the KDA paths: the compute dtype rule and the L2 norm convention.

Both follow flash-linear-attention (fla) so that the torch paths and fla's kernels agree:
``l2norm(x) = x / sqrt(sum(x^2) + 1e-6)`` (eps inside the root, not ``F.normalize``'s clamp).
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 when the inputs are fp64 (exact reference checks), fp32 otherwise (bf16/fp16/fp32)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS, scale: float = 1.0) -> torch.Tensor:
    """``scale *`` L2-normalised last dimension, fla's convention (eps added under the square root)."""
    r = torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
    return x * (r * scale if scale != 1.0 else r)
