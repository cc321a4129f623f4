"""MXFP4 codec in plain torch (any device): the CPU path, and the CUDA fallback without triton.

Owns: `quantize_torch` and `dequantize_torch`, chunked over blocks. Does not own: the format's
rules and input checks (`spec.py`), the dispatch between paths (`api.py`).

Non-negative floats order like their bit patterns, so the scale byte is integer arithmetic on
bits(A), and "round(|x| / 2^s) against the E2M1 decision points" can be decided as
"bits(|x|) against bits(point * 2^s)" with the points scaled per block by an exact integer ldexp:
no float arithmetic touches an element, so denormal flushing cannot change a code. This path does
that for fp32/fp16; for bf16 it is cheaper to form y = x * 2^-s in bf16 (the library's own
intermediate) and look its 16 bits up in a 64K-entry code table. It runs over chunks of blocks,
so temporaries stay a few MB whatever the tensor size.
"""

from __future__ import annotations

import torch

from k3core.ops.mxfp4.spec import (
    BLOCK,
    E2M1_VALUES,
    EXP_INF,
    MIDPOINTS,
    NAN_SCALE,
    NEG_ZERO_FIELD,
    ROUND_BIAS,
    check_dequantize_input,
    check_quantize_input,
    check_scale_rule,
    raise_non_finite,
)

__all__ = ["quantize_torch", "dequantize_torch", "CPU_CHUNK_BLOCKS", "CUDA_CHUNK_BLOCKS"]

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


def _scale_bytes(amax: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """Block maxima as fp32 bits (int32 [G]) -> E8M0 bytes (int32 [G]); 255 for inf/NaN."""
    field = (amax + ROUND_BIAS[scale_rule]) >> 23
    scale = (field - 2).clamp_(min=0)
    return torch.where(amax >= EXP_INF, NAN_SCALE, scale)


_MID_FIELD = torch.tensor([f for f, _, _ in MIDPOINTS], dtype=torch.int32)
_MID_FRAC = torch.tensor([fr for _, fr, _ in MIDPOINTS], dtype=torch.int32)
_MID_TIE_UP = torch.tensor([int(t) for _, _, t in MIDPOINTS], dtype=torch.int32)


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
    for i in range(len(MIDPOINTS)):
        code += (mag > points[:, i : i + 1]).view(torch.uint8)  # bool as 0/1 bytes
    keeps_sign = (bits < 0) & (mag > _ldexp_bits(NEG_ZERO_FIELD[blocks.dtype], 0, s))
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
        for f, frac, tie_up in MIDPOINTS:
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
    check_scale_rule(scale_rule)
    check_quantize_input(w)
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
    if bool((scale_blocks == NAN_SCALE).any()):
        raise_non_finite(w, name)
    return packed, scale

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
    bits = torch.where(b == NAN_SCALE, 0x7FC00000, bits)
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
    check_dequantize_input(packed, scale, dtype)
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
