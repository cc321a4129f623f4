"""Triton kernels for ``k3core.ops.norms`` (the contract: its ``__init__``). One program per row (a
token, or a token's head for KDA's per-head norm), the whole row in registers, fp32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + r * stride_x + cols, mask=m, other=0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, 0) / D + eps)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=m, other=0).to(tl.float32)
    tl.store(y_ptr + r * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _attn_res_mix_kernel(v_ptr, wg_ptr, y_ptr, D, stride_c, stride_n, stride_y, eps, C: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Online softmax over the C candidates of one row: each candidate read once."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    wg = tl.load(wg_ptr + cols, mask=m, other=0).to(tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    best = -float("inf")
    total = 0.0
    for c in tl.static_range(C):
        v = tl.load(v_ptr + c * stride_c + r * stride_n + cols, mask=m, other=0).to(tl.float32)
        score = tl.sum(v * tl.math.rsqrt(tl.sum(v * v, 0) / D + eps) * wg, 0)
        new = tl.maximum(best, score)
        keep = tl.exp(best - new)
        p = tl.exp(score - new)
        acc = acc * keep + p * v
        total = total * keep + p
        best = new
    tl.store(y_ptr + r * stride_y + cols, (acc / total).to(y_ptr.dtype.element_ty), mask=m)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``k3core.model.norm.rms_norm`` in one kernel: x ``[..., D]`` -> x's dtype."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and D:
        block = triton.next_power_of_2(D)
        w = weight.contiguous() if weight is not None else x2
        _rms_norm_kernel[(x2.shape[0],)](x2, w, y, D, x2.stride(0), y.stride(0), eps, HAS_W=weight is not None,
                                         BLOCK=block, num_warps=_warps(block))
    return y.view(x.shape)


def attn_res_mix(p: torch.Tensor, blocks: list[torch.Tensor], w_gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """``k3core.model.attnres.attn_res_mix`` in one kernel after one stack of the candidates (in their
    own dtype: the upcast happens in registers)."""
    D = p.shape[-1]
    V = torch.stack([b.to(p.dtype) for b in blocks] + [p], dim=0).reshape(len(blocks) + 1, -1, D)
    n = V.shape[1]
    y = torch.empty(n, D, dtype=p.dtype, device=p.device)
    if n and D:
        block = triton.next_power_of_2(D)
        _attn_res_mix_kernel[(n,)](V, w_gamma.contiguous(), y, D, V.stride(0), V.stride(1), y.stride(0), eps,
                                   C=V.shape[0], BLOCK=block, num_warps=_warps(block))
    return y.view(p.shape)
