"""The MXFP4 format (the release's compressed-tensors `mxfp4-pack-quantized` layout) and the input
contract every path of the codec shares.

Owns: the format's constants, the scale and rounding rules as data, input validation and the
non-finite error. Does not own: any quantising arithmetic (`codec_torch.py`, `codec_triton.py`,
`naive.py`). Imports nothing from the rest of the package, so every path can import it.

Format (k3-architecture.md, "MXFP4"):
- elements are FP4 E2M1, code `sign << 3 | magnitude`, magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6} for codes 0..7; codes 8..15 are the negatives;
- 32 consecutive elements along the last dim share one E8M0 scale, stored as the biased exponent
  byte b (scale value 2^(b - 127));
- two elements per byte, the lower index in the LOW nibble.

Scale rule, per block with absolute maximum A:
- "compressed-tensors" (the release; default): A is rounded to a power of two, up when its
  mantissa is >= 1.75, down otherwise; exponent = log2(that) - 2. In bits (how the library does
  it): field = (bits(A) + 2^21) >> 23, b = max(field - 2, 0).
- "ocp" (plain OCP MX v1.0 floor rule): exponent = floor(log2(A)) - 2, i.e.
  b = max((bits(A) >> 23) - 2, 0).
An all-zero block gets b = 0; so does every block whose exponent falls below E8M0's range.
Elements are divided by the scale and rounded to the nearest E2M1 value, ties to even,
saturating at +-6 (only the OCP rule reaches it: block maxima in [1.75, 2) * 2^k become
y in [7, 8), which round to 8 and saturate to 6).

Where this follows compressed-tensors 0.20.0 rather than the plain words of the spec (checked
against its source: `quantization/utils/mxfp_utils.py`, `quant_args.py` `cast_to_fp4`,
`compressors/nvfp4/helpers.py` `pack_fp4_to_uint8`, and bit-exact in the tests):
- Signed zeros. The library computes y = x / scale in the INPUT dtype, then sign(y) * |round(y)|
  and takes the sign bit of that. So an element that rounds to zero gets code 8 ("-0") when
  y < 0, but code 0 when x is -0.0 (torch.sign(-0.0) == 0) or when y underflowed to -0.0 in the
  input dtype: |y| <= 2^-134 for bf16, <= 2^-150 for fp32. We reproduce exactly that; the second
  case needs a negative element 2^130 times smaller than its block maximum, so it never happens
  in real weights, but it is what the bytes are.
- A >= 1.75 * 2^127 (the largest finite floats): the library's power of two overflows to inf and
  its scale byte comes from casting inf to int32 (undefined; 127 on x86). We give the value the
  rule means, b = 253 (exponent 126). Such weights do not occur; no bit-exactness is claimed there.
- fp16 input: the library computes the scale in fp16, where 2^(b-127) underflows for blocks with
  A < ~2^-22 and is silently replaced by 1 (b = 127). We convert fp16 to fp32 (exact) and follow
  the fp32 rule instead, so quantize(w_fp16) == quantize(w_fp16.float()).
- Scale byte 255 is E8M0 NaN; quantize never writes it for finite input (b <= 253), and
  dequantize decodes a block with b = 255 to NaN (the library would give +-inf, or NaN for zeros).
"""

from __future__ import annotations

import torch

BLOCK = 32
SCALE_RULES = ("compressed-tensors", "ocp")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Magnitudes of codes 0..7 (codes 8..15 are the same with the sign set).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# The 7 decision points between consecutive E2M1 magnitudes, as (biased fp32 exponent, 23-bit
# fraction, ties round up). A magnitude y gets code = number of points it passes, where y passes a
# point t when y > t, or y >= t if ties round up: ties go to the even code (mantissa bit 0),
# exactly the library's `cast_to_fp4` table. Saturation is built in: everything above 5 is code 7.
MIDPOINTS = (
    (125, 0x000000, False),  # 0.25 = 1.00b * 2^-2: tie -> 0   (code 0)
    (126, 0x400000, True),  # 0.75 = 1.10b * 2^-1: tie -> 1   (code 2)
    (127, 0x200000, False),  # 1.25 = 1.01b * 2^0:  tie -> 1   (code 2)
    (127, 0x600000, True),  # 1.75 = 1.11b * 2^0:  tie -> 2   (code 4)
    (128, 0x200000, False),  # 2.5  = 1.01b * 2^1:  tie -> 2   (code 4)
    (128, 0x600000, True),  # 3.5  = 1.11b * 2^1:  tie -> 4   (code 6)
    (129, 0x200000, False),  # 5.0  = 1.01b * 2^2:  tie -> 4   (code 6)
)
# A negative element keeps its sign bit only if x / scale does not underflow to zero in the
# input dtype (see the module docstring): |y| must exceed half the dtype's smallest subnormal.
# Biased exponents of 2^-134 (bf16) and 2^-150 (fp32; fp16 is treated as fp32).
NEG_ZERO_FIELD = {torch.bfloat16: 127 - 134, torch.float32: 127 - 150, torch.float16: 127 - 150}
# Rounding bias added to bits(A) before truncating to the exponent: +0.25 in the mantissa makes
# mantissas >= 1.75 carry into the next power of two (compressed-tensors `round_to_power_2`).
ROUND_BIAS = {"compressed-tensors": 1 << 21, "ocp": 0}

EXP_INF = 0x7F800000  # bits of +inf; |x| bits >= this means inf or NaN
NAN_SCALE = 255  # E8M0 NaN: written for blocks with a non-finite element, then reported


def check_scale_rule(scale_rule: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"mxfp4: scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")


def check_quantize_input(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"mxfp4.quantize: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in INPUT_DTYPES:
        raise ValueError(f"mxfp4.quantize: dtype must be bfloat16, float16 or float32, got {w.dtype}")
    if w.ndim == 0 or w.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"mxfp4.quantize: the last dimension must be a multiple of {BLOCK}, got shape {tuple(w.shape)}"
        )


def check_dequantize_input(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    for label, t in (("packed", packed), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"mxfp4.dequantize: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            hint = " (int8 bytes: pass .view(torch.uint8))" if t.dtype == torch.int8 else ""
            raise ValueError(f"mxfp4.dequantize: {label} must be uint8, got {t.dtype}{hint}")
        if t.ndim == 0:
            raise ValueError(f"mxfp4.dequantize: {label} must have at least one dimension")
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"mxfp4.dequantize: dtype must be bfloat16, float16 or float32, got {dtype}")
    if (
        packed.shape[:-1] != scale.shape[:-1]
        or packed.shape[-1] != scale.shape[-1] * (BLOCK // 2)
    ):
        raise ValueError(
            f"mxfp4.dequantize: packed {tuple(packed.shape)} and scale {tuple(scale.shape)} do not "
            f"match: expected packed [..., n/2] and scale [..., n/32]"
        )
    if packed.device != scale.device:
        raise ValueError(f"mxfp4.dequantize: packed on {packed.device} but scale on {scale.device}")


def raise_non_finite(w: torch.Tensor, name: str | None) -> None:
    """Called once a block was found non-finite: locate the first bad element and raise."""
    flat = int(torch.nonzero(~torch.isfinite(w.reshape(-1)))[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), w.shape))
    value = float(w.reshape(-1)[flat])
    label = f"tensor {name!r}" if name is not None else "tensor"
    raise ValueError(
        f"mxfp4.quantize: {label} of shape {tuple(w.shape)} has a non-finite value {value} at index {index}"
    )
