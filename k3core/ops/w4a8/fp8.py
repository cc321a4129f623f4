"""FP8 E4M3 activation quantisation for the W4A8 expert matmuls (torch, any device).

Owns: ``quantize_fp8``, ``dequantize_fp8``, ``fake_quantize_fp8`` and their scale rules. Does not
own: the matmuls (``api.py``), the scalar reference (``naive.py``).

Activations, FP8 E4M3 (``torch.float8_e4m3fn``: 1 sign, 4 exponent bits with bias 7, 3 mantissa
bits, no infinities, largest finite 448, smallest subnormal 2^-9), with one of two scale choices:
- ``"token"`` (default): one fp32 scale per row (token), ``scale = amax(|x|) / 448``, so the row's
  largest element maps to exactly +-448 and nothing saturates; a row of zeros gets the smallest
  normal fp32 as its scale (its codes are all zero). The scale factors out of the matmul
  (``y[n] = scale[n] * (q[n] @ W^T)``), so it is applied to the fp32 product, after the matmul.
- ``"block32"``: one E8M0 scale per 32 consecutive elements along the last dim (OCP MXFP8's
  layout, uint8 biased exponent b, scale 2^(b-127)), chosen as the SMALLEST power of two with
  ``amax <= 448 * scale`` (exponent ``ceil(log2(amax / 448))``, exact in integer arithmetic on
  the fp32 bits). OCP's own rule (``floor(log2(amax)) - 8``) clips block maxima in (448, 512) *
  2^k to 448; this rule never clips, at the price of at most one bit of range. An all-zero block
  gets byte 0. Power-of-two scales keep fp8 * scale exact in bf16, so the scaled activations can
  feed a bf16 matmul without another rounding.
Elements are ``x / scale`` (per token, an fp32 division) or ``x * 2^-e`` (per block, exact),
clamped to [-448, 448] and rounded to nearest E4M3, ties to even (torch's cast; the clamp makes
the result independent of how a torch version casts out-of-range values: saturating or NaN).
NaN propagates (a NaN element stays NaN; a row or block holding inf or NaN gets a NaN scale, byte
255 for block32), so a broken activation is visible in the output, not hidden by the quantiser.
"""

from __future__ import annotations

import torch

from k3core.ops.mxfp4.spec import BLOCK

__all__ = ["FP8_DTYPE", "FP8_MAX", "ACT_GRANULARITIES", "quantize_fp8", "dequantize_fp8", "fake_quantize_fp8",
           "check_granularity"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
ACT_GRANULARITIES = ("token", "block32")
_NAN_SCALE = 255
# 448 = 1.75 * 2^8: a block maximum with fp32 mantissa fraction above 0.75 (0x600000) does not
# fit under 448 * 2^(E - 8) and needs exponent E - 7.
_FP8_MAX_FRAC = 0x600000
_FP8_MAX_EXP = 8


def check_granularity(granularity: str) -> None:
    if granularity not in ACT_GRANULARITIES:
        raise ValueError(f"w4a8: activation granularity must be one of {ACT_GRANULARITIES}, got {granularity!r}")


def _block32_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """fp32 block maxima (>= 0) -> E8M0 bytes (int32): the smallest 2^(b-127) with amax <= 448 * it.

    With amax = (1 + f) * 2^(field - 127): b = field - 8 + (f > 0.75), clamped to [0, 254]; a
    subnormal or zero maximum gets byte 0 (2^-127: everything still fits); inf/NaN get 255."""
    bits = amax.view(torch.int32)
    field = bits >> 23
    frac = bits & 0x7FFFFF
    b = (field - _FP8_MAX_EXP + (frac > _FP8_MAX_FRAC).to(torch.int32)).clamp_(0, 254)
    return torch.where(field == 255, _NAN_SCALE, b)


def _e8m0_values(byte: torch.Tensor) -> torch.Tensor:
    """uint8/int32 E8M0 bytes -> fp32 2^(b-127) (2^-127 is an fp32 subnormal; 255 -> NaN)."""
    b = byte.to(torch.int32)
    normal = (b.clamp(min=1) << 23).view(torch.float32)
    value = torch.where(b == 0, torch.tensor(2.0**-127, dtype=torch.float32, device=b.device), normal)
    return torch.where(b == _NAN_SCALE, torch.tensor(float("nan"), device=b.device), value)


def quantize_fp8(x: torch.Tensor, granularity: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[..., K]`` (bf16/fp16/fp32) -> (q ``float8_e4m3fn [..., K]``, scale).

    ``granularity="token"``: scale fp32 ``[..., 1]``, x ~ q * scale.
    ``granularity="block32"``: scale uint8 E8M0 ``[..., K/32]`` (K % 32 == 0), x ~ q * 2^(scale - 127)
    blockwise. See the module docstring for the scale rules."""
    check_granularity(granularity)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w4a8.quantize_fp8: dtype must be bfloat16, float16 or float32, got {x.dtype}")
    xf = x.float()
    if granularity == "token":
        amax = xf.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else xf.new_zeros(*x.shape[:-1], 1)
        amax = torch.where(torch.isfinite(xf).all(-1, keepdim=True), amax, float("nan"))
        # a tensor divisor: CUDA computes ``t / python_scalar`` as ``t * (1 / scalar)``, which is not the
        # IEEE quotient the rule (and the fused kernel, and the CPU) use
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=torch.finfo(torch.float32).tiny)  # NaN passes clamp
        q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q, scale
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"w4a8.quantize_fp8: block32 needs the last dimension to be a multiple of {BLOCK}, "
                         f"got shape {tuple(x.shape)}")
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    nonfinite = ~torch.isfinite(blocks).all(-1)
    amax = blocks.abs().amax(-1).masked_fill_(nonfinite, float("inf"))
    scale = _block32_scale_bytes(amax)
    # 2^(127-b) as fp32 bits: normal for b in [0, 253]; b = 254 (amax near the fp32 maximum) is 2^-127
    inv = ((254 - scale).clamp(1, 254) << 23).view(torch.float32)
    inv = torch.where(scale == 254, torch.tensor(2.0**-127, device=x.device), inv)
    q = (blocks * inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(x.shape)
    return q, scale.to(torch.uint8)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: ``[..., K]`` in ``dtype``. The granularity is read from the scale:
    fp32 ``[..., 1]`` is per token, uint8 ``[..., K/32]`` per 32-block."""
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"w4a8.dequantize_fp8: q must be float8_e4m3fn, got {q.dtype}")
    qf = q.float()
    if scale.dtype == torch.uint8:
        s = _e8m0_values(scale)
        out = (qf.reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK) * s.unsqueeze(-1)).reshape(q.shape)
    elif scale.dtype == torch.float32:
        out = qf * scale
    else:
        raise ValueError(f"w4a8.dequantize_fp8: scale must be fp32 (per token) or uint8 E8M0 (per block), got {scale.dtype}")
    return out.to(dtype)


def fake_quantize_fp8(x: torch.Tensor, granularity: str = "token") -> torch.Tensor:
    """What a W4A8 engine feeds its expert matmuls instead of x: FP8 round trip, in x's dtype."""
    q, s = quantize_fp8(x, granularity)
    return dequantize_fp8(q, s, x.dtype)
