"""Slow scalar MXFP4 reference, written from the spec (k3-architecture.md, "MXFP4"), for tests.

One Python loop per block and per element, exact arithmetic on Python floats (doubles hold every
bf16/fp16/fp32 value and every x / 2^s exactly), `math.frexp` for exponents, and the nearest
E2M1 value found by distance, not by thresholds. Shares no code with the fast paths
(`codec_torch.py`, `codec_triton.py`) nor with `spec.py`, so agreement between them is evidence,
not tautology. Use on small tensors only: one Python step per element.
"""

from __future__ import annotations

import math

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def scale_byte(absmax: float, scale_rule: str = "compressed-tensors") -> int:
    """E8M0 byte of a block with absolute maximum `absmax` (finite, >= 0)."""
    if absmax == 0.0:
        return 0  # log2(0) = -inf, clamped to the bottom of the E8M0 range
    mantissa, exponent = math.frexp(absmax)  # absmax = mantissa * 2^exponent, 0.5 <= mantissa < 1
    power = exponent - 1  # floor(log2(absmax)); absmax = (2 * mantissa) * 2^power
    if scale_rule == "compressed-tensors":
        if 2 * mantissa >= 1.75:  # the block max rounds up to the next power of two
            power += 1
    elif scale_rule != "ocp":
        raise ValueError(scale_rule)
    return min(max(power - 2 + 127, 0), 254)


def nearest_e2m1(magnitude: float) -> int:
    """Code 0..7 of the E2M1 value nearest to `magnitude` >= 0, ties to the even code, saturating."""
    magnitude = min(magnitude, 6.0)
    best = 0
    for code in range(1, 8):
        d_new, d_best = abs(E2M1[code] - magnitude), abs(E2M1[best] - magnitude)
        if d_new < d_best or (d_new == d_best and code % 2 == 0):
            best = code
    return best


def _underflow_limit(dtype: torch.dtype) -> float:
    """|x / scale| at or below which the library's division in `dtype` gives a (signed) zero:
    half the smallest subnormal (round half to even). fp16 is handled as fp32 (see spec.py)."""
    return 2.0**-134 if dtype == torch.bfloat16 else 2.0**-150


def quantize_reference(
    w: torch.Tensor, scale_rule: str = "compressed-tensors"
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] -> (packed uint8 [..., n/2], scale uint8 [..., n/32]), element by element."""
    n = w.shape[-1]
    assert n % 32 == 0
    limit = _underflow_limit(w.dtype)
    blocks = w.detach().cpu().to(torch.float64).reshape(-1, 32).tolist()
    packed, scales = [], []
    for block in blocks:
        byte = scale_byte(max(abs(x) for x in block), scale_rule)
        scale = 2.0 ** (byte - 127)
        codes = []
        for x in block:
            y = x / scale
            negative = x < 0 and abs(y) > limit  # -0.0 < 0 is False: -0.0 encodes as +0
            codes.append(nearest_e2m1(abs(y)) | (8 if negative else 0))
        packed.extend(codes[i] | (codes[i + 1] << 4) for i in range(0, 32, 2))
        scales.append(byte)
    lead = tuple(w.shape[:-1])
    return (
        torch.tensor(packed, dtype=torch.uint8).reshape(*lead, n // 2),
        torch.tensor(scales, dtype=torch.uint8).reshape(*lead, n // 32),
    )


def dequantize_reference(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(packed [..., n/2], scale [..., n/32]) -> dtype [..., n], element by element."""
    out = []
    for row_bytes, row_scales in zip(
        packed.cpu().reshape(-1, 16).tolist(), scale.cpu().reshape(-1).tolist()
    ):
        for byte in row_bytes:
            for code in (byte & 15, byte >> 4):  # low nibble first
                if row_scales == 255:
                    out.append(math.nan)
                    continue
                sign = -1.0 if code & 8 else 1.0
                out.append(sign * E2M1[code & 7] * 2.0 ** (row_scales - 127))
    lead = tuple(packed.shape[:-1])
    return torch.tensor(out, dtype=torch.float64).to(dtype).reshape(*lead, packed.shape[-1] * 2)
