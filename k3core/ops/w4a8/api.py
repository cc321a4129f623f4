"""W4A8 expert matmuls: MXFP4 weights (packed, as the release stores them) times FP8 E4M3 activations.

Owns: FP8 E4M3 activation quantisation (two granularities) and the matmuls an MXFP4 rollout
engine runs for routed experts, ``y = fp8(x) @ mxfp4(W)^T``, for one weight or for a stack of
experts over rows sorted by expert. Does not own: the MXFP4 codec (``k3core.ops.mxfp4``), which
module holds the weights (``k3core.rollout.quantized.W4A8Experts``).

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

Matmuls. Every decoded MXFP4 weight (E2M1 value * 2^(b-127)) and every decoded FP8 activation
(times a power-of-two scale) is exact in fp32 and bf16, so the only roundings are the FP8
rounding of x and the accumulation. The torch path (CPU, and CUDA without triton) decodes the
weights of the experts in use to fp32 per call (no decoded copy is kept) and multiplies in fp32.
On CUDA with triton, ``grouped_mm_triton.w4a8_grouped_mm_triton`` decodes MXFP4 inside the matmul's
K loop (bf16 tensor cores, fp32 accumulation). ``w4a8_reference`` is the plain fp64 version.
"""

from __future__ import annotations

import torch

from k3core.ops.mxfp4 import BLOCK, dequantize

__all__ = [
    "FP8_MAX",
    "ACT_GRANULARITIES",
    "quantize_fp8",
    "dequantize_fp8",
    "fake_quantize_fp8",
    "w4a8_linear",
    "w4a8_grouped_mm",
    "w4a8_reference",
    "fp8_e4m3_values",
    "round_to_e4m3_reference",
    "quantize_fp8_reference",
    "triton_available",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
ACT_GRANULARITIES = ("token", "block32")
_NAN_SCALE = 255
# 448 = 1.75 * 2^8: a block maximum with fp32 mantissa fraction above 0.75 (0x600000) does not
# fit under 448 * 2^(E - 8) and needs exponent E - 7.
_FP8_MAX_FRAC = 0x600000
_FP8_MAX_EXP = 8


def _check_granularity(granularity: str) -> None:
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
    _check_granularity(granularity)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w4a8.quantize_fp8: dtype must be bfloat16, float16 or float32, got {x.dtype}")
    xf = x.float()
    if granularity == "token":
        amax = xf.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else xf.new_zeros(*x.shape[:-1], 1)
        amax = torch.where(torch.isfinite(xf).all(-1, keepdim=True), amax, float("nan"))
        scale = (amax / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)  # NaN passes clamp
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


def _check_weights(packed: torch.Tensor, wscale: torch.Tensor, k: int, stacked: bool) -> None:
    nd = 3 if stacked else 2
    if packed.dtype != torch.uint8 or wscale.dtype != torch.uint8:
        raise ValueError(f"w4a8: packed weights and scales must be uint8, got {packed.dtype} and {wscale.dtype}")
    if packed.ndim != nd or wscale.ndim != nd:
        raise ValueError(f"w4a8: expected {nd}-d packed/scale tensors, got {tuple(packed.shape)} and {tuple(wscale.shape)}")
    if packed.shape[-1] * 2 != k or wscale.shape[-1] * BLOCK != k or packed.shape[:-1] != wscale.shape[:-1]:
        raise ValueError(f"w4a8: activations have K={k}, weights packed {tuple(packed.shape)} scale "
                         f"{tuple(wscale.shape)} (expected [..., M, K/2] and [..., M, K/32])")


def _activations_fp32(x: torch.Tensor, granularity: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(activations as the matmul sees them, in fp32; per-row scale to apply after, or None)."""
    if granularity is None:  # weight-only MXFP4 (W4A16): activations as they are
        return x.float(), None
    q, s = quantize_fp8(x, granularity)
    if granularity == "token":
        return q.float(), s
    return dequantize_fp8(q, s, torch.float32), None


def w4a8_linear(x: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor,
                granularity: str | None = "token") -> torch.Tensor:
    """x ``[..., K]`` times one MXFP4 weight (packed ``[M, K/2]``, scale ``[M, K/32]``) -> ``[..., M]``
    in x's dtype: ``fp8(x) @ W^T`` (``granularity=None``: x unquantised, weight-only MXFP4)."""
    if granularity is not None:
        _check_granularity(granularity)
    _check_weights(packed, wscale, x.shape[-1], stacked=False)
    a, s = _activations_fp32(x, granularity)
    y = a @ dequantize(packed, wscale, torch.float32).t()
    return (y if s is None else y * s).to(x.dtype)


def triton_available() -> bool:
    """True when the fused Triton kernel can be imported (CUDA torch with triton installed)."""
    try:
        import k3core.ops.w4a8.grouped_mm_triton  # noqa: F401
    except ImportError:
        return False
    return True


def w4a8_grouped_mm(x_sorted: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor,
                    granularity: str | None = "token", out_dtype: torch.dtype | None = None,
                    use_triton: bool | None = None) -> torch.Tensor:
    """Rows sorted by expert times that expert's MXFP4 weight.

    x_sorted ``[n, K]``; counts ``[E]`` (rows per expert, summing to n); packed uint8 ``[E, M, K/2]``;
    wscale uint8 ``[E, M, K/32]`` -> ``[n, M]`` in ``out_dtype`` (default x's dtype), row i of expert
    e being ``fp8(x_i) @ W_e^T``. On CUDA with triton the fused kernel runs (``use_triton`` forces a
    choice); otherwise each expert in use is decoded to fp32 (one expert at a time) and multiplied."""
    if granularity is not None:
        _check_granularity(granularity)
    _check_weights(packed, wscale, x_sorted.shape[-1], stacked=True)
    E, M = packed.shape[0], packed.shape[1]
    if counts.shape != (E,):
        raise ValueError(f"w4a8: counts has shape {tuple(counts.shape)}, expected ({E},)")
    out_dtype = out_dtype or x_sorted.dtype
    if use_triton is None:
        use_triton = x_sorted.is_cuda and granularity is not None and triton_available()
    if use_triton:
        from k3core.ops.w4a8.grouped_mm_triton import w4a8_grouped_mm_triton

        q, s = quantize_fp8(x_sorted, granularity)
        return w4a8_grouped_mm_triton(q, s, counts, packed, wscale, out_dtype)
    a, s = _activations_fp32(x_sorted, granularity)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            outs.append(a[start:start + n] @ dequantize(packed[e], wscale[e], torch.float32).t())
            start += n
    out = torch.cat(outs) if outs else a.new_zeros(0, M)
    if s is not None:
        out = out * s
    return out.to(out_dtype)


# ------------------------------------------------------------------ plain reference (tests)
def fp8_e4m3_values() -> list[float]:
    """The 127 non-negative finite E4M3 (fn) values, ascending, from the format's definition:
    code c = e << 3 | m, value m/8 * 2^-6 for e = 0 (subnormals), (1 + m/8) * 2^(e-7) otherwise;
    code 0x7F (e = 15, m = 7) is NaN, so the largest is (1 + 6/8) * 2^8 = 448."""
    vals = []
    for c in range(0x7F):
        e, m = c >> 3, c & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


_E4M3 = fp8_e4m3_values()


def round_to_e4m3_reference(v: float) -> float:
    """Nearest E4M3 value to the float v (ties to the even code), saturating at +-448; NaN stays NaN."""
    if v != v:
        return v
    mag = min(abs(v), FP8_MAX)
    best = 0
    for c in range(1, len(_E4M3)):
        d_new, d_best = abs(_E4M3[c] - mag), abs(_E4M3[best] - mag)
        if d_new < d_best or (d_new == d_best and c % 2 == 0):
            best = c
    return -_E4M3[best] if v < 0 else _E4M3[best]


def _fp32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).to(torch.float32))


def quantize_fp8_reference(x: torch.Tensor, granularity: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """Element-by-element ``quantize_fp8`` in fp64 (small tensors): (E4M3 values ``[..., K]``, the
    scale of each element ``[..., K]``), so ``values * scales`` is the dequantised activation.

    Scales follow the module docstring from the definitions (``amax / 448`` rounded to fp32 per token;
    the smallest power of two 2^e with ``amax <= 448 * 2^e`` per block, e >= -127, by search), each
    element ``x / scale`` rounded to fp32 (per token; exact per block) then to E4M3 by distance."""
    rows = x.detach().float().reshape(-1, x.shape[-1]).tolist()
    values, scales = [], []
    for row in rows:
        if granularity == "token":
            amax = max((abs(v) for v in row), default=0.0)
            scale = max(_fp32(amax / FP8_MAX), 2.0**-126)
            values.append([round_to_e4m3_reference(_fp32(v / scale)) for v in row])
            scales.append([scale] * len(row))
        else:
            vals, scs = [], []
            for i in range(0, len(row), BLOCK):
                block = row[i:i + BLOCK]
                amax = max(abs(v) for v in block)
                e = -127
                while amax > FP8_MAX * 2.0**e:
                    e += 1
                vals.extend(round_to_e4m3_reference(v * 2.0**-e) for v in block)
                scs.extend([2.0**e] * len(block))
            values.append(vals)
            scales.append(scs)
    shape = x.shape
    return (torch.tensor(values, dtype=torch.float64).reshape(shape),
            torch.tensor(scales, dtype=torch.float64).reshape(shape))


def w4a8_reference(x: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor,
                   granularity: str | None = "token") -> torch.Tensor:
    """fp64 ``fp8(x) @ W^T`` for one weight: x ``[N, K]`` -> ``[N, M]`` fp64, with the scalar MXFP4
    decoder of ``mxfp4.naive`` and the scalar FP8 rounding above (shares no code with the fast path)."""
    from k3core.ops.mxfp4.naive import dequantize_reference

    w = dequantize_reference(packed, wscale, torch.float32).to(torch.float64)
    if granularity is None:
        return x.detach().to(torch.float64) @ w.t()
    values, scales = quantize_fp8_reference(x, granularity)
    return (values * scales) @ w.t()
