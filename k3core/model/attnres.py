"""Block Attention Residuals (AttnRes): the depth-wise softmax mix of block snapshots.

The residual stream between layers is the partial sum ``p`` of the current block beside a list
``B`` of completed block snapshots (the embedding output is the first). ``mix`` scores every
candidate ``v`` in ``B + [p]`` with ``s = sum_i (v_i / rms(v)) * w_i * gamma_i`` (rms without a
weight, fp32) and returns ``sum_v softmax(s)_v * v`` in the activation dtype.

``w * gamma`` depends only on weights. Inference engines precompute it; that cache must be
recomputed whenever weights change (``K3ForCausalLM.refresh_inference_caches``), or rollouts
silently use stale scores. Training never uses the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from k3core.model.norm import at_least_fp32
from k3core.ops.compiled import compiled, use_compiled
from k3core.ops.norms import use_fused


def attn_res_mix(p: torch.Tensor, blocks: list[torch.Tensor], w_gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """p ``[..., D]``, blocks: list of ``[..., D]``, w_gamma ``[D]`` -> ``[..., D]`` (p's dtype). Inference
    on CUDA runs it as one stack and one kernel (``k3core.ops.norms``), the trainer on CUDA as its
    torch.compile'd form (``k3core.ops.compiled``); ``attn_res_mix_reference`` is the reference of both."""
    if all(b.dtype == p.dtype and b.shape == p.shape for b in blocks) and use_fused(p, w_gamma, *blocks):
        from k3core.ops.norms.fused_triton import attn_res_mix as fused

        return fused(p, blocks, w_gamma, eps)
    if use_compiled(p):
        return compiled(attn_res_mix_reference)(p, list(blocks), w_gamma, eps)
    return attn_res_mix_reference(p, blocks, w_gamma, eps)


def attn_res_mix_reference(p: torch.Tensor, blocks: list[torch.Tensor], w_gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """The mix in plain torch ops (the module docstring's formula)."""
    V = at_least_fp32(torch.stack(list(blocks) + [p], dim=0))  # [C, ..., D]
    normed = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    scores = (normed * w_gamma.to(V.dtype)).sum(-1)  # [C, ...]
    weights = torch.softmax(scores, dim=0)
    return (weights.unsqueeze(-1) * V).sum(0).to(p.dtype)


class ResProj(nn.Module):
    """Holds a public ``<name>.weight`` of shape ``[1, D]`` (w: a Linear(D, 1) without bias).
    Zero-initialised, so a fresh model starts with a uniform average over the candidates."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, dim))


class ResNorm(nn.Module):
    """Holds a public ``<name>.weight`` of shape ``[D]`` (gamma)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def w_gamma(proj: ResProj, norm: ResNorm) -> torch.Tensor:
    """The score vector ``w * gamma`` ``[D]`` of one mixing site, in fp32 whatever the weights' dtype: the
    scores are fp32 sums, and a bf16 product would move them (SGLang's ``get_cw`` keeps it fp32 too;
    tests/interop/test_sglang_reference_ops.py)."""
    return at_least_fp32(proj.weight[0]) * at_least_fp32(norm.weight)
