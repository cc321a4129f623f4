"""Triton kernels for SiTU-GLU (see `k3core/ops/situ.py` for the contract and the torch paths).

Imported lazily by `situ.py`: importing this module needs triton (present with CUDA torch,
absent on CPU-only hosts). Both kernels read x = [gate | up] as bf16/fp16/fp32, do all math in
fp32 registers and write the input dtype, so nothing but the outputs touches HBM:
forward reads 2 and writes 1 element per output element, backward reads 3 and writes 2.

Tiles are [BLOCK_R rows, BLOCK_H columns] with the columns contiguous in memory, so loads and
stores vectorise; offsets are int64 (R * 2H exceeds 2^31 at 100k tokens x 16 experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Elements per program and warps, picked for a memory-bound elementwise kernel on H100/H200
# (16 resp. 8 fp32 values per thread). `benchmarks/situ.py --device cuda --sweep` times others.
FWD_ELEMS, FWD_WARPS = 4096, 8
BWD_ELEMS, BWD_WARPS = 2048, 8
MAX_BLOCK_H = 1024


@triton.jit(do_not_specialize=["R"])
def _situ_glu_fwd_kernel(
    x_ptr, out_ptr, R, H, beta, linear_beta, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < R)[:, None] & (cols < H)[None, :]
    gate_ptrs = x_ptr + rows[:, None] * (2 * H) + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + H, mask=mask, other=0.0).to(tl.float32)
    # tanh (libdevice) and sigmoid = 1 / (1 + exp(-g)) saturate to +-1 and 0/1, never NaN.
    a = beta * libdevice.tanh(gate / beta) * tl.sigmoid(gate)
    b = linear_beta * libdevice.tanh(up / linear_beta)
    out_ptrs = out_ptr + rows[:, None] * H + cols[None, :]
    tl.store(out_ptrs, (a * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _situ_glu_bwd_kernel(
    x_ptr,
    grad_ptr,
    dx_ptr,
    R,
    H,
    stride_grad_r,
    stride_grad_c,
    beta,
    linear_beta,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < R)[:, None] & (cols < H)[None, :]
    gate_offs = rows[:, None] * (2 * H) + cols[None, :]
    gate = tl.load(x_ptr + gate_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + gate_offs + H, mask=mask, other=0.0).to(tl.float32)
    grad_ptrs = grad_ptr + rows[:, None] * stride_grad_r + cols[None, :] * stride_grad_c
    grad = tl.load(grad_ptrs, mask=mask, other=0.0).to(tl.float32)
    tg = libdevice.tanh(gate / beta)
    s = tl.sigmoid(gate)
    tu = libdevice.tanh(up / linear_beta)
    # d/dg [beta*tanh(g/beta)*sigmoid(g)] = s * ((1 - tg^2) + beta*tg*(1 - s)); d/du [lb*tanh(u/lb)] = 1 - tu^2
    d_gate = grad * (linear_beta * tu) * s * ((1.0 - tg * tg) + beta * tg * (1.0 - s))
    d_up = grad * (beta * tg * s) * (1.0 - tu * tu)
    tl.store(dx_ptr + gate_offs, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + gate_offs + H, d_up.to(dx_ptr.dtype.element_ty), mask=mask)


def launch_config(hidden: int, elems: int, num_warps: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps) for a tile of about `elems` elements of a row of `hidden`."""
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(hidden))
    block_r = max(1, elems // block_h)
    return block_r, block_h, num_warps


def situ_glu_fwd(
    x2d: torch.Tensor, beta: float, linear_beta: float, config: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """x2d: [R, 2H] contiguous -> out [R, H] in x2d.dtype."""
    R, H = x2d.shape[0], x2d.shape[1] // 2
    out = torch.empty(R, H, dtype=x2d.dtype, device=x2d.device)
    if out.numel() == 0:
        return out
    block_r, block_h, num_warps = config or launch_config(H, FWD_ELEMS, FWD_WARPS)
    grid = (triton.cdiv(R, block_r), triton.cdiv(H, block_h))
    with torch.cuda.device(x2d.device):
        _situ_glu_fwd_kernel[grid](
            x2d, out, R, H, beta, linear_beta, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps
        )
    return out


def situ_glu_bwd(
    x2d: torch.Tensor,
    grad2d: torch.Tensor,
    beta: float,
    linear_beta: float,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x2d: [R, 2H] contiguous, grad2d: [R, H] any strides -> d_x = [d_gate | d_up], [R, 2H]."""
    R, H = x2d.shape[0], x2d.shape[1] // 2
    dx = torch.empty_like(x2d)
    if dx.numel() == 0:
        return dx
    block_r, block_h, num_warps = config or launch_config(H, BWD_ELEMS, BWD_WARPS)
    grid = (triton.cdiv(R, block_r), triton.cdiv(H, block_h))
    with torch.cuda.device(x2d.device):
        _situ_glu_bwd_kernel[grid](
            x2d,
            grad2d,
            dx,
            R,
            H,
            grad2d.stride(0),
            grad2d.stride(1),
            beta,
            linear_beta,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            num_warps=num_warps,
        )
    return dx
