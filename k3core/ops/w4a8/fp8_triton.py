"""Triton kernel for per-token FP8 activation quantisation (the rules and the torch path: ``fp8.py``).

Imported lazily (it needs triton), by ``api.py`` before the fused expert matmul. One program
quantises one row: its amax, the scale ``amax / 448`` (an IEEE fp32 division, ``div_rn``, as torch's),
then every element ``x / scale`` (``div_rn``), clamped to [-448, 448] and rounded to E4M3, nearest
with ties to even, in integer arithmetic (``_to_e4m3``; a hardware or interpreter cast may flush
subnormals). That is ``quantize_fp8(x, "token")`` byte for byte (for rows whose largest magnitude
is at least 1e-32: below, an fp32-subnormal element, which the GPU's division flushes to zero,
could quantise to a nonzero code; activations never come near), in one kernel where the
torch path runs about eleven (upcast, abs, amax, finiteness, divisions, clamps, cast), each called
twice per MoE layer in every decode step. NaN handling follows ``fp8.py``: a row holding inf or NaN
gets a NaN scale, so its codes are NaN; comparisons, not min/max, do the clamps, since fmin/fmax
would drop a NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3core.ops.w4a8.fp8 import FP8_DTYPE, FP8_MAX

_TINY = torch.finfo(torch.float32).tiny


@triton.jit
def _to_e4m3(y):
    """fp32 values in [-448, 448] (or NaN) -> int32 E4M3 (fn) codes, rounded to nearest, ties to even,
    in integer arithmetic on the fp32 bits (the same on every GPU, triton version and the interpreter):
    a normal result keeps the top 3 mantissa bits, the round carrying into the exponent; below 2^-6,
    the subnormal code m = round(|y| * 2^9), 8 being the normal 2^-6 that the same bits spell."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    normal = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20  # biased exponent << 3 | mantissa, rounded
    normal = normal - (120 << 3)  # exponent bias 127 -> 7
    e = a >> 23
    full = (a & 0x7FFFFF) | 0x800000  # 1.f as an integer, value full * 2^(e - 150)
    shift = tl.minimum(141 - e, 31)  # |y| * 2^9 = full * 2^(e - 141): an integer after 141 - e shifts
    sub = (full + (1 << (shift - 1)) - 1 + ((full >> shift) & 1)) >> shift
    code = tl.where(e >= 121, normal, sub)
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN
    return code | sign


@triton.jit
def _quantize_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FMAX: tl.constexpr, TINY: tl.constexpr,
                           BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    x = tl.load(x_ptr + r * stride_x + cols, mask=m, other=0).to(tl.float32)
    ax = tl.abs(x)
    finite = ax < float("inf")  # False for +-inf and NaN
    all_finite = tl.min(tl.where(m, finite, True).to(tl.int32), 0)
    amax = tl.max(tl.where(finite, ax, 0.0), 0)
    scale = tl.math.div_rn(amax, FMAX)
    scale = tl.where(scale < TINY, TINY, scale)
    scale = tl.where(all_finite == 1, scale, float("nan"))
    y = tl.math.div_rn(x, scale)
    y = tl.where(y > FMAX, FMAX, tl.where(y < -FMAX, -FMAX, y))
    tl.store(q_ptr + r * stride_q + cols, _to_e4m3(y).to(tl.uint8), mask=m)
    tl.store(s_ptr + r, scale)


def quantize_fp8_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[n, K]`` (bf16/fp16/fp32) -> (q ``float8_e4m3fn [n, K]``, scale fp32 ``[n, 1]``): what
    ``quantize_fp8(x, "token")`` returns, in one kernel."""
    if x.ndim != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize_fp8_token_triton: expected a 2-d bf16/fp16/fp32 tensor, got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    n, K = x.shape
    q = torch.empty(n, K, dtype=torch.uint8, device=x.device)
    s = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    if n and K:
        block = triton.next_power_of_2(K)
        _quantize_token_kernel[(n,)](x, q, s, K, x.stride(0), q.stride(0), FMAX=FP8_MAX, TINY=_TINY, BLOCK=block,
                                     num_warps=4 if block <= 1024 else 8)
    elif n:
        s.fill_(_TINY)
    return q.view(FP8_DTYPE), s
