"""Triton kernels for SiTU-GLU (the contract: the package docstring; the dispatch: `api.py`).

Imported lazily by `api.py`: importing this module needs triton (present with CUDA torch,
absent on CPU-only hosts). Both kernels read x = [gate | up] as bf16/fp16/fp32, do all math in
fp32 registers and write the input dtype, so nothing but the outputs touches HBM:
forward reads 2 and writes 1 element per output element, backward reads 3 and writes 2.

tanh and sigmoid are built from exp2 as fractions n/d with d in [1, 2] (`_tanh_frac`,
`_sigmoid_frac`), so both kernels need 3 exp2 and 1 division per element (libdevice tanh plus
sigmoid would take about 6 special-function ops: at bf16 traffic the forward would then be as
much bound by the SFUs as by HBM), and 1 - tanh^2, 1 - sigmoid come without cancellation.
With TRITON_INTERPRET=1 the kernels also run on CPU tensors (tests do that where triton exists).

With exact fp32-grade arithmetic both kernels are ALU-bound before they are HBM-bound at bf16
traffic (docs/results/situ.md), so for 16-bit outputs (``FAST``) they trade precision the output
cannot hold:
- forward: tanh from the hardware ``tanh.approx.f32`` (relative error < 2^-10.9), sigmoid as
  1 / (1 + 2^(-g log2 e)) with a fast (non-IEEE) division. The output is then within one bf16
  rounding plus 2^-10 relative of the exact value (tests state that bound);
- backward: the same fractions as the exact path (no cancellation in 1 - tanh^2, 1 - sigmoid, which
  the gradient needs) with a two-term series below 2^-6 and a fast division.
fp32 inputs keep the exact path (and so does the Triton interpreter, which has no inline asm).

Tiles are [BLOCK_R rows, BLOCK_H columns] with the columns contiguous in memory, so loads and
stores vectorise; offsets are int64 (R * 2H exceeds 2^31 at 100k tokens x 16 experts).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Elements per program and warps: the best tiles of `benchmarks/situ.py --device cuda --sweep`
# (docs/results/situ.md).
FWD_ELEMS, FWD_WARPS = 4096, 8
BWD_ELEMS, BWD_WARPS = 2048, 4
MAX_BLOCK_H = 1024

# The interpreter (TRITON_INTERPRET=1, read at import like @triton.jit does) cannot run inline asm.
HW_TANH = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# Below SMALL, tanh(a) comes from its odd series a - a^3/3 + 2a^5/15 - 17a^7/315 + 62a^9/2835
# (next term < 1e-8 relative), because (1 - e^-2a) / (1 + e^-2a) loses digits to cancellation.
SMALL: tl.constexpr = tl.constexpr(0.25)
C3: tl.constexpr = tl.constexpr(-1.0 / 3.0)
C5: tl.constexpr = tl.constexpr(2.0 / 15.0)
C7: tl.constexpr = tl.constexpr(-17.0 / 315.0)
C9: tl.constexpr = tl.constexpr(62.0 / 2835.0)
# FAST (16-bit outputs): below SMALL_FAST the series stops at a^3 (next term 2a^5/15 < 2^-31 a);
# above it, 1 - z loses at most 2^-22 / 2^-5 = 2^-17 relative: both far below a bf16 rounding.
SMALL_FAST: tl.constexpr = tl.constexpr(1.0 / 64.0)


@triton.jit
def _tanh_hw(x):
    """tanh(x) by the SFU's tanh.approx.f32 (sm_75+): relative error below 2^-10.9."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _tanh_frac_fast(y, inv_scale):
    """`_tanh_frac` for 16-bit outputs: a two-term series below SMALL_FAST."""
    a = tl.abs(y) * inv_scale
    z = tl.exp2(a * (-2.0 * LOG2E))
    small = a < SMALL_FAST
    p = a * (1.0 + (a * a) * C3)
    n = tl.where(small, p, 1.0 - z)
    d = tl.where(small, 1.0, 1.0 + z)
    e = tl.where(small, 1.0 - p * p, 4.0 * z)
    return tl.where(y < 0, -n, n), d, e


@triton.jit
def _tanh_frac(y, inv_scale):
    """tanh(y * inv_scale) = n / d and 1 - tanh^2 = e / d^2, with d in [1, 2].

    With a = |y| * inv_scale and z = exp(-2a) in [0, 1]: tanh = (1 - z) / (1 + z) and
    1 - tanh^2 = 4z / (1 + z)^2, free of cancellation and overflow (z -> 0 saturates exactly);
    small a uses the series with d = 1. Returning fractions lets callers share one reciprocal.
    """
    a = tl.abs(y) * inv_scale
    z = tl.exp2(a * (-2.0 * LOG2E))
    small = a < SMALL
    a_s = tl.minimum(a, SMALL)  # keeps the unused series finite for huge or infinite a
    a2 = a_s * a_s
    p = a_s * (1.0 + a2 * (C3 + a2 * (C5 + a2 * (C7 + a2 * C9))))
    n = tl.where(small, p, 1.0 - z)
    d = tl.where(small, 1.0, 1.0 + z)
    e = tl.where(small, 1.0 - p * p, 4.0 * z)
    return tl.where(y < 0, -n, n), d, e


@triton.jit
def _sigmoid_frac(g):
    """sigmoid(g) = n / d and 1 - sigmoid(g) = m / d, with z = exp(-|g|) and d = 1 + z in [1, 2]."""
    z = tl.exp2(tl.abs(g) * (-LOG2E))
    pos = g >= 0
    return tl.where(pos, 1.0, z), 1.0 + z, tl.where(pos, z, 1.0)


@triton.jit(do_not_specialize=["R"])
def _situ_glu_fwd_kernel(
    x_ptr, out_ptr, R, H, beta, linear_beta, inv_beta, inv_lb, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    FAST: tl.constexpr = False
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < R)[:, None] & (cols < H)[None, :]
    gate_ptrs = x_ptr + rows[:, None] * (2 * H) + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + H, mask=mask, other=0.0).to(tl.float32)
    if FAST:
        # 2 tanh.approx + 1 exp2 + 1 fast division; 2^(+large) = inf gives sigmoid 0 exactly
        sig = tl.fdiv(1.0, 1.0 + tl.exp2(gate * (-LOG2E)))
        out = (beta * linear_beta) * (_tanh_hw(gate * inv_beta) * sig * _tanh_hw(up * inv_lb))
    else:
        n1, d1, _e1 = _tanh_frac(gate, inv_beta)
        n2, d2, _m2 = _sigmoid_frac(gate)
        n3, d3, _e3 = _tanh_frac(up, inv_lb)
        # beta*tanh(g/beta) * sigmoid(g) * lb*tanh(u/lb): three exp2 and one division per element
        out = (beta * linear_beta) * (n1 * n2 * n3) / (d1 * d2 * d3)
    out_ptrs = out_ptr + rows[:, None] * H + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


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
    inv_beta,
    inv_lb,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FAST: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < R)[:, None] & (cols < H)[None, :]
    gate_offs = rows[:, None] * (2 * H) + cols[None, :]
    gate = tl.load(x_ptr + gate_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + gate_offs + H, mask=mask, other=0.0).to(tl.float32)
    # int64 column term too: a transposed gradient has a column stride of R
    grad_ptrs = grad_ptr + rows[:, None] * stride_grad_r + cols[None, :].to(tl.int64) * stride_grad_c
    grad = tl.load(grad_ptrs, mask=mask, other=0.0).to(tl.float32)
    if FAST:
        n1, d1, e1 = _tanh_frac_fast(gate, inv_beta)
        n3, d3, e3 = _tanh_frac_fast(up, inv_lb)
    else:
        n1, d1, e1 = _tanh_frac(gate, inv_beta)
        n3, d3, e3 = _tanh_frac(up, inv_lb)
    n2, d2, m2 = _sigmoid_frac(gate)
    if FAST:
        r = tl.fdiv(1.0, d1 * d2 * d3)
    else:
        r = 1.0 / (d1 * d2 * d3)  # one division; each 1/d_i is r times the other two
    r1, r2, r3 = r * d2 * d3, r * d1 * d3, r * d1 * d2
    tg, s, tu = n1 * r1, n2 * r2, n3 * r3  # tanh(g/beta), sigmoid(g), tanh(u/lb)
    one_m_tg2, one_m_s, one_m_tu2 = e1 * r1 * r1, m2 * r2, e3 * r3 * r3
    gs = grad * s
    # d/dg [beta*tanh(g/beta)*sigmoid(g)] = s * ((1 - tg^2) + beta*tg*(1 - s)); d/du [lb*tanh(u/lb)] = 1 - tu^2
    d_gate = gs * (linear_beta * tu) * (one_m_tg2 + beta * tg * one_m_s)
    d_up = gs * (beta * tg) * one_m_tu2
    tl.store(dx_ptr + gate_offs, d_gate.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + gate_offs + H, d_up.to(dx_ptr.dtype.element_ty), mask=mask)


def fast_mode(x: torch.Tensor) -> bool:
    """The reduced-precision arithmetic (module docstring) for 16-bit tensors, exact for fp32."""
    return x.dtype in (torch.bfloat16, torch.float16)


def launch_config(hidden: int, elems: int, num_warps: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps) for a tile of about `elems` elements of a row of `hidden`."""
    block_h = min(MAX_BLOCK_H, triton.next_power_of_2(hidden))
    block_r = max(1, elems // block_h)
    return block_r, block_h, num_warps


def situ_glu_fwd(
    x2d: torch.Tensor, beta: float, linear_beta: float, config: tuple[int, int, int] | None = None,
    fast: bool | None = None,
) -> torch.Tensor:
    """x2d: [R, 2H] contiguous -> out [R, H] in x2d.dtype. `fast`: default `fast_mode(x2d)`."""
    R, H = x2d.shape[0], x2d.shape[1] // 2
    out = torch.empty(R, H, dtype=x2d.dtype, device=x2d.device)
    if out.numel() == 0:
        return out
    block_r, block_h, num_warps = config or launch_config(H, FWD_ELEMS, FWD_WARPS)
    grid = (triton.cdiv(R, block_r), triton.cdiv(H, block_h))
    with torch.cuda.device_of(x2d):  # launch on x2d's GPU (a no-op for CPU tensors, TRITON_INTERPRET=1)
        _situ_glu_fwd_kernel[grid](
            x2d,
            out,
            R,
            H,
            beta,
            linear_beta,
            1.0 / beta,
            1.0 / linear_beta,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            FAST=(fast_mode(x2d) if fast is None else fast) and HW_TANH,
            num_warps=num_warps,
        )
    return out


def situ_glu_bwd(
    x2d: torch.Tensor,
    grad2d: torch.Tensor,
    beta: float,
    linear_beta: float,
    config: tuple[int, int, int] | None = None,
    fast: bool | None = None,
) -> torch.Tensor:
    """x2d: [R, 2H] contiguous, grad2d: [R, H] any strides -> d_x = [d_gate | d_up], [R, 2H]."""
    R, H = x2d.shape[0], x2d.shape[1] // 2
    dx = torch.empty_like(x2d)
    if dx.numel() == 0:
        return dx
    block_r, block_h, num_warps = config or launch_config(H, BWD_ELEMS, BWD_WARPS)
    grid = (triton.cdiv(R, block_r), triton.cdiv(H, block_h))
    with torch.cuda.device_of(x2d):  # launch on x2d's GPU (a no-op for CPU tensors, TRITON_INTERPRET=1)
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
            1.0 / beta,
            1.0 / linear_beta,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            FAST=fast_mode(x2d) if fast is None else fast,
            num_warps=num_warps,
        )
    return dx
