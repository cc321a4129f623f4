"""MXFP4 codec: the release's compressed-tensors `mxfp4-pack-quantized` layout, bit for bit.

Owns: turning a float weight [..., n] into (packed [..., n/2], scale [..., n/32]) uint8 tensors
and back, plus a straight-through fake-quantizer for QAT. Does not own: which tensors are
quantised (the checkpoint code decides that from `quantization_config.ignore`), file I/O.

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

Implementation. Non-negative floats order like their bit patterns, so the scale byte is integer
arithmetic on bits(A), and "round(|x| / 2^s) against the E2M1 decision points" can be decided as
"bits(|x|) against bits(point * 2^s)" with the points scaled per block by an exact integer ldexp:
no float arithmetic touches an element, so denormal flushing cannot change a code. The torch path
does that for fp32/fp16; for bf16 it is faster to form y = x * 2^-s in bf16 (the library's own
intermediate) and look its 16 bits up in a 64K-entry code table. It runs over chunks of blocks,
so temporaries stay a few MB whatever the tensor size. On CUDA the integer form runs as Triton
kernels (`codec_triton.py`); the torch path is the fallback there.
The slow, obviously-right scalar version is `naive.py`.
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "SCALE_RULES",
    "quantize",
    "dequantize",
    "fake_quantize",
    "quantize_torch",
    "dequantize_torch",
    "triton_available",
]

BLOCK = 32
SCALE_RULES = ("compressed-tensors", "ocp")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Magnitudes of codes 0..7 (codes 8..15 are the same with the sign set).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# The 7 decision points between consecutive E2M1 magnitudes, as (biased fp32 exponent, 23-bit
# fraction, ties round up). A magnitude y gets code = number of points it passes, where y passes a
# point t when y > t, or y >= t if ties round up: ties go to the even code (mantissa bit 0),
# exactly the library's `cast_to_fp4` table. Saturation is built in: everything above 5 is code 7.
_MIDPOINTS = (
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
_NEG_ZERO_FIELD = {torch.bfloat16: 127 - 134, torch.float32: 127 - 150, torch.float16: 127 - 150}
# Rounding bias added to bits(A) before truncating to the exponent: +0.25 in the mantissa makes
# mantissas >= 1.75 carry into the next power of two (compressed-tensors `round_to_power_2`).
_ROUND_BIAS = {"compressed-tensors": 1 << 21, "ocp": 0}

_EXP_INF = 0x7F800000  # bits of +inf; |x| bits >= this means inf or NaN
_NAN_SCALE = 255  # E8M0 NaN: written for blocks with a non-finite element, then reported

# Blocks per chunk of the CPU path: 8192 blocks = 256K elements, 2-5 MB of temporaries (smaller
# chunks pay more per-chunk overhead, larger ones fall out of cache).
CPU_CHUNK_BLOCKS = 8192
# On CUDA the torch fallback uses larger chunks: launches, not cache, are what limit it there.
CUDA_CHUNK_BLOCKS = 1 << 17


def _ldexp_bits(field: int | torch.Tensor, frac: int | torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bits of the fp32 value (1 + frac / 2^23) * 2^(field - 127 + k), exact, as int32.

    `field` is a biased exponent that may lie outside [1, 254]; `k` an int32 tensor. A result
    below the normal range is returned as the subnormal it is (bits shifted right: exact for every
    value this module forms, whose low bits are zero), 0 when it is below 2^-150. A result of
    2^128 or more returns bits >= 0x7F800000, which compare above every finite magnitude; callers
    that need a float clamp them to inf.
    """
    f = k + field
    normal = (f << 23) | frac
    subnormal = (frac | 0x800000) >> (1 - f).clamp(0, 31)
    return torch.where(f >= 1, normal, subnormal)


def _check_scale_rule(scale_rule: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"mxfp4: scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")


def _check_quantize_input(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"mxfp4.quantize: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in INPUT_DTYPES:
        raise ValueError(f"mxfp4.quantize: dtype must be bfloat16, float16 or float32, got {w.dtype}")
    if w.ndim == 0 or w.shape[-1] % BLOCK != 0:
        raise ValueError(
            f"mxfp4.quantize: the last dimension must be a multiple of {BLOCK}, got shape {tuple(w.shape)}"
        )


def _raise_non_finite(w: torch.Tensor, name: str | None) -> None:
    """Called once a block was found non-finite: locate the first bad element and raise."""
    flat = int(torch.nonzero(~torch.isfinite(w.reshape(-1)))[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), w.shape))
    value = float(w.reshape(-1)[flat])
    label = f"tensor {name!r}" if name is not None else "tensor"
    raise ValueError(
        f"mxfp4.quantize: {label} of shape {tuple(w.shape)} has a non-finite value {value} at index {index}"
    )


def _scale_bytes(amax: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """Block maxima as fp32 bits (int32 [G]) -> E8M0 bytes (int32 [G]); 255 for inf/NaN."""
    field = (amax + _ROUND_BIAS[scale_rule]) >> 23
    scale = (field - 2).clamp_(min=0)
    return torch.where(amax >= _EXP_INF, _NAN_SCALE, scale)


_MID_FIELD = torch.tensor([f for f, _, _ in _MIDPOINTS], dtype=torch.int32)
_MID_FRAC = torch.tensor([fr for _, fr, _ in _MIDPOINTS], dtype=torch.int32)
_MID_TIE_UP = torch.tensor([int(t) for _, _, t in _MIDPOINTS], dtype=torch.int32)


def _quantize_blocks_by_compare(blocks: torch.Tensor, scale_rule: str):
    """fp32/fp16 [G, 32] -> (codes uint8 [G, 32], scale int32 [G]), integer-only.

    Each |x| (as bits) is compared with the 7 decision points scaled to its block, t * 2^s, with
    "t <= y" folded into "t - 1ulp < y": the code is the number of points strictly below |x|.
    """
    bits = blocks.to(torch.float32).view(torch.int32)  # fp16 -> fp32 is exact
    mag = bits & 0x7FFFFFFF
    scale = _scale_bytes(mag.amax(dim=1), scale_rule)
    s = (scale - 127).unsqueeze(1)  # [G, 1] exponent of the applied scale
    f = s + _MID_FIELD.to(s.device)  # [G, 7] scaled decision points, as in _ldexp_bits
    frac = _MID_FRAC.to(s.device)
    points = torch.where(f >= 1, (f << 23) | frac, (frac | 0x800000) >> (1 - f).clamp(0, 31))
    points -= _MID_TIE_UP.to(s.device)
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for i in range(len(_MIDPOINTS)):
        code += (mag > points[:, i : i + 1]).view(torch.uint8)  # bool as 0/1 bytes
    keeps_sign = (bits < 0) & (mag > _ldexp_bits(_NEG_ZERO_FIELD[blocks.dtype], 0, s))
    code.add_(keeps_sign.view(torch.uint8), alpha=8)
    return code, scale


_BF16_CODE_TABLES: dict[torch.device, torch.Tensor] = {}


def _bf16_code_table(device: torch.device) -> torch.Tensor:
    """[65536] uint8: the E2M1 code of every bf16 bit pattern y, by the library's rule: the
    magnitude by the decision points (ties to even, saturating) and the sign bit iff y < 0."""
    table = _BF16_CODE_TABLES.get(device)
    if table is None:
        y = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
        mag = y.abs()
        code = torch.zeros(65536, dtype=torch.uint8)
        for f, frac, tie_up in _MIDPOINTS:
            t = (1 + frac / 2**23) * 2.0 ** (f - 127)
            code += (mag >= t) if tie_up else (mag > t)
        code += 8 * (y < 0)  # strict: -0.0 encodes as +0, like torch.sign in the library
        table = _BF16_CODE_TABLES[device] = code.to(device)
    return table


def _quantize_blocks_bf16(blocks: torch.Tensor, scale_rule: str):
    """bf16 [G, 32] -> (codes uint8 [G, 32], scale int32 [G]) through a 64K-entry table.

    y = x * 2^-s is computed in bf16, which is exactly the library's x / scale in bf16 (product
    of a bf16 and a power of two, rounded once, underflowing to a signed zero the same way), and
    every bf16 y has a fixed code: one multiply and one table lookup replace 8 compares. Exact as
    long as denormals are not flushed (torch's default; the library itself depends on it too).
    """
    xi = blocks.view(torch.int16)
    amax = (xi & 0x7FFF).amax(dim=1).to(torch.int32) << 16  # fp32 bits of the block max
    scale = _scale_bytes(amax, scale_rule)
    inv_scale = ((254 - scale).clamp_(1, 254) << 23).view(torch.float32)  # 2^(127 - byte), normal
    y = blocks * inv_scale.to(torch.bfloat16).unsqueeze(1)
    index = y.view(torch.uint16).to(torch.int32).reshape(-1)
    code = torch.index_select(_bf16_code_table(blocks.device), 0, index).view(-1, BLOCK)
    return code, scale


def _quantize_blocks(blocks: torch.Tensor, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[G, 32] float blocks -> (packed uint8 [G, 16], scale uint8 [G]); 255 marks non-finite."""
    if blocks.dtype == torch.bfloat16:
        code, scale = _quantize_blocks_bf16(blocks, scale_rule)
    else:
        code, scale = _quantize_blocks_by_compare(blocks, scale_rule)
    packed = torch.add(code[:, 0::2], code[:, 1::2], alpha=16)  # low nibble = lower index
    return packed, scale.to(torch.uint8)


def _chunks(n_blocks: int, device: torch.device):
    step = CUDA_CHUNK_BLOCKS if device.type == "cuda" else CPU_CHUNK_BLOCKS
    for start in range(0, n_blocks, step):
        yield start, min(start + step, n_blocks)


def quantize_torch(
    w: torch.Tensor, *, scale_rule: str = "compressed-tensors", name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch path of `quantize` (any device), chunked over blocks; same contract."""
    _check_scale_rule(scale_rule)
    _check_quantize_input(w)
    n = w.shape[-1]
    lead = w.shape[:-1]
    packed = torch.empty(*lead, n // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(*lead, n // BLOCK, dtype=torch.uint8, device=w.device)
    packed_blocks = packed.view(-1, BLOCK // 2)
    scale_blocks = scale.view(-1)
    # A non-contiguous input is made contiguous per row chunk when 2-D (a transposed weight),
    # else copied once: reshape keeps views where it can.
    if w.is_contiguous() or w.ndim != 2:
        src = w.reshape(-1, BLOCK)
        for lo, hi in _chunks(src.shape[0], w.device):
            packed_blocks[lo:hi], scale_blocks[lo:hi] = _quantize_blocks(src[lo:hi], scale_rule)
    else:
        per_row = n // BLOCK
        step = CUDA_CHUNK_BLOCKS if w.device.type == "cuda" else CPU_CHUNK_BLOCKS
        rows = max(1, step // max(per_row, 1))
        for r in range(0, w.shape[0], rows):
            chunk = w[r : r + rows].contiguous().view(-1, BLOCK)
            lo, hi = r * per_row, r * per_row + chunk.shape[0]
            packed_blocks[lo:hi], scale_blocks[lo:hi] = _quantize_blocks(chunk, scale_rule)
    if bool((scale_blocks == _NAN_SCALE).any()):
        _raise_non_finite(w, name)
    return packed, scale


def _check_dequantize_input(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
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


_PAIR_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_pair_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256] table whose entry b holds the two element values of packed byte b (low nibble first)
    in `dtype` (bf16 or fp32), viewed as one int32/int64, so that a single `torch.take` decodes
    a byte (several times faster on CPU than indexing a [256, 2] table)."""
    table = _PAIR_TABLES.get((device, dtype))
    if table is None:
        values = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype)
        byte = torch.arange(256)
        pairs = torch.stack([values[byte & 15], values[byte >> 4]], dim=1).contiguous()
        wide = torch.int32 if dtype == torch.bfloat16 else torch.int64
        table = _PAIR_TABLES[(device, dtype)] = pairs.view(wide).reshape(256).to(device)
    return table


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> fp32 2^(b - 127), from bits; b = 0 is the subnormal 2^-127, b = 255 NaN."""
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    bits = torch.where(b == _NAN_SCALE, 0x7FC00000, bits)
    return bits.view(torch.float32)


def dequantize_torch(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Torch path of `dequantize` (any device), chunked over blocks; same contract.

    An element value times its power-of-two scale has at most 2 significant bits, so the product
    is exact in bf16 and fp32 (computed there directly) and rounds once for fp16 (computed in
    fp32, then converted). Blocks with scale byte 0 or 1 produce subnormals: exact as long as
    denormals are not flushed (torch's default).
    """
    _check_dequantize_input(packed, scale, dtype)
    lead, n = packed.shape[:-1], packed.shape[-1] * 2
    out = torch.empty(*lead, n, dtype=dtype, device=packed.device)
    if out.numel() == 0:
        return out
    compute = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    table = _byte_pair_table(packed.device, compute)
    src = packed.reshape(-1, BLOCK // 2)
    scales = scale.reshape(-1)
    dst = out.view(-1, BLOCK)
    for lo, hi in _chunks(src.shape[0], packed.device):
        values = torch.take(table, src[lo:hi].to(torch.int64)).view(compute)  # [g, 32]
        scale_values = _scale_values(scales[lo:hi]).to(compute).unsqueeze(1)
        if compute == dtype:
            torch.mul(values, scale_values, out=dst[lo:hi])
        else:
            dst[lo:hi] = values.mul_(scale_values)
    return out


def triton_available() -> bool:
    """True when the Triton kernels can be imported (CUDA torch with triton installed)."""
    try:
        import k3core.ops.mxfp4.codec_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def quantize(
    w: torch.Tensor, *, scale_rule: str = "compressed-tensors", name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w [..., n] (bf16/fp16/fp32, n % 32 == 0) to MXFP4.

    Returns (packed uint8 [..., n/2], scale uint8 [..., n/32]) on w's device, in the release's
    compressed-tensors layout (`weight_packed`, `weight_scale`). `scale_rule` picks the
    exponent rule ("compressed-tensors", the release's, or "ocp", the plain floor rule). Raises
    ValueError for a bad dtype or shape, and for inf/NaN (naming `name` and the first bad index).
    Runs the Triton kernel on CUDA when triton is importable, else the chunked torch path.
    """
    _check_scale_rule(scale_rule)
    _check_quantize_input(w)
    if _use_triton(w):
        from k3core.ops.mxfp4.codec_triton import quantize_triton

        return quantize_triton(w, scale_rule=scale_rule, name=name)
    return quantize_torch(w, scale_rule=scale_rule, name=name)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Decode (packed uint8 [..., n/2], scale uint8 [..., n/32]) to a `dtype` tensor [..., n].

    Exact for bf16 and fp32 output (every decoded value is representable), correctly rounded for
    fp16. Code 8 decodes to -0.0; a block with scale byte 255 (E8M0 NaN) decodes to NaN.
    """
    _check_dequantize_input(packed, scale, dtype)
    if _use_triton(packed):
        from k3core.ops.mxfp4.codec_triton import dequantize_triton

        return dequantize_triton(packed, scale, dtype)
    return dequantize_torch(packed, scale, dtype)


class _FakeQuantizeSTE(torch.autograd.Function):
    """dequantize(quantize(w)) forward; the gradient passes through unchanged (straight-through)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale_rule: str) -> torch.Tensor:
        packed, scale = quantize(w.detach(), scale_rule=scale_rule)
        return dequantize(packed, scale, dtype=w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quantize(w: torch.Tensor, *, scale_rule: str = "compressed-tensors") -> torch.Tensor:
    """MXFP4 round trip of w [..., n] in w's dtype, for QAT: forward is what an MXFP4 engine sees,
    backward is the identity (straight-through estimator)."""
    return _FakeQuantizeSTE.apply(w, scale_rule)
