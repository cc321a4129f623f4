"""Plain W4A8 references, written from the formats' definitions (small tensors, tests).

The FP8 E4M3 values are enumerated from the format, each element rounded by distance (not by a
cast), scales found by search, and the MXFP4 weights decoded by the scalar ``k3core.ops.mxfp4.naive``;
everything in fp64. Shares no arithmetic with the fast paths (``fp8.py``, ``api.py``,
``grouped_mm_triton.py``), so agreement between them is evidence, not tautology.
"""

from __future__ import annotations

import torch

from k3core.ops.mxfp4.naive import dequantize_reference
from k3core.ops.mxfp4.spec import BLOCK
from k3core.ops.w4a8.fp8 import FP8_MAX

__all__ = ["fp8_e4m3_values", "round_to_e4m3_reference", "quantize_fp8_reference", "w4a8_reference"]


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

    Scales follow the rules in ``fp8.py``'s docstring, from the definitions (``amax / 448`` rounded to fp32 per token;
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
    decoder of ``k3core.ops.mxfp4.naive`` and the scalar FP8 rounding above (shares no code with the fast path)."""
    w = dequantize_reference(packed, wscale, torch.float32).to(torch.float64)
    if granularity is None:
        return x.detach().to(torch.float64) @ w.t()
    values, scales = quantize_fp8_reference(x, granularity)
    return (values * scales) @ w.t()
