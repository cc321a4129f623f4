"""Triton kernels of the MXFP4 codec (the format and its checks: `spec.py`; the dispatch: `api.py`).

Imported lazily by `api.py`: importing this module needs triton. Every kernel is the torch path's
integer arithmetic on fp32 bit patterns, one program per GROUPS blocks of 32 elements:
- quantize reads each block once, reduces |x| bits to the block max, forms the scale byte and the
  per-block decision points, places each |x| among them by a 3-level binary search (`_codes`) or,
  in the bf16x2 kernel, by bf16x2 arithmetic, and packs; it writes 16 bytes + 1 scale
  byte per block. No float arithmetic touches an element, so flushing denormals cannot change a
  code (the bf16x2 kernel's float instructions are exact by construction: `_bytes_bf16x2`).
- dequantize builds each output value's fp32 bits with integer arithmetic (an add and a shift per
  element for ordinary scales; an exact integer ldexp for the subnormal/NaN scale bytes), then
  narrows to the output dtype.
The kernels stay memory-bound only while their per-element work fits the GPU's ratio of int32
issue rate to HBM bandwidth, a handful of integer operations per element (the budget is worked out
in docs/results/mxfp4.md), which is why the element math is written this way. Offsets are int64:
tensors past 2^31 elements exist (a full expert stack).

Quantize kernels (`quantize_triton(kernel=...)`; all give the same bytes):
- "bf16x2" (`_quantize_bf16x2_kernel`; bf16 on sm_80+, the default there): each thread owns whole
  blocks on a [GROUPS, 4, 4] view of the input as int32 words, so the block max is thread-local
  and nothing changes layout through shared memory, and the codes of blocks with ordinary scale
  bytes come from bf16x2 instructions, two elements each (`_bytes_bf16x2`).
- "words" (`_quantize_bf16_kernel`; bf16 on older GPUs and under the Triton interpreter, which
  cannot run inline PTX): one row per packed output word, integer codes; its per-block values
  change layout through shared memory.
- "generic" (`_mxfp4_quantize_kernel`; any dtype, the one fp16/fp32 use): `tl.reshape` + `tl.split`.
Dequantize has one kernel for every dtype (`tl.join` layout). The throughput of each kernel, the
candidates that lost and the tile sweeps behind the constants below: docs/results/mxfp4.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# As a module, not its names: the kernels' constexpr parameters are called ROUND_BIAS, NEG_ZERO_FIELD.
import k3core.ops.mxfp4.spec as spec

# Blocks per program and warps: the best tiles of `benchmarks/mxfp4.py --device cuda --sweep`
# (docs/results/mxfp4.md). Generic quantize: 128 blocks = 4096 elements per program.
QUANT_GROUPS, QUANT_WARPS = 128, 8
DEQUANT_GROUPS, DEQUANT_WARPS = 128, 4
# bf16 quantize (both kernels); at 128 blocks x 4 warps each bf16x2 thread owns one whole block.
BF16_QUANT_GROUPS, BF16_QUANT_WARPS = 128, 4
# The bf16 kernel "auto" picks on sm_80+ (bf16x2 instructions).
AUTO_BF16_KERNEL = "bf16x2"
QUANTIZE_KERNELS = ("auto", "generic", "words", "bf16x2")


@triton.jit
def _ldexp_bits(field, frac, k):
    """Bits of (1 + frac/2^23) * 2^(field - 127 + k) as int32; same as codec_torch._ldexp_bits."""
    f = k + field
    normal = (f << 23) | frac
    shift = tl.minimum(tl.maximum(1 - f, 0), 31)
    subnormal = (frac | 0x800000) >> shift
    return tl.where(f >= 1, normal, subnormal)


@triton.jit
def _mxfp4_quantize_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    nonfinite_ptr,
    n_groups,
    ROUND_BIAS: tl.constexpr,
    NEG_ZERO_FIELD: tl.constexpr,
    IS_BF16: tl.constexpr,
    GROUPS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    gmask = g < n_groups
    cols = tl.arange(0, 32)
    mask = gmask[:, None]
    x = tl.load(x_ptr + g[:, None] * 32 + cols[None, :], mask=mask, other=0.0)
    if IS_BF16:
        # bf16 is the top half of fp32: widen the bits, no float conversion.
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    amax = tl.max(mag, axis=1)  # [GROUPS]; bits order like values for non-negative floats
    field = (amax + ROUND_BIAS) >> 23
    scale = tl.maximum(field - 2, 0)
    nonfinite = amax >= 0x7F800000
    scale = tl.where(nonfinite, 255, scale)  # E8M0 NaN for a block with inf/NaN
    if tl.max(nonfinite.to(tl.int32), axis=0) > 0:
        tl.atomic_max(nonfinite_ptr, 1)  # one flag for the host, instead of a pass over `scale`
    # per-block decision points, then a 3-level binary search per element (see `_codes`)
    code = _codes(mag, bits < 0, (scale - 127)[:, None], NEG_ZERO_FIELD)
    lo, hi_nib = tl.split(tl.reshape(code, (GROUPS, 16, 2)))
    packed = (lo | (hi_nib << 4)).to(tl.uint8)
    pcols = tl.arange(0, 16)
    tl.store(packed_ptr + g[:, None] * 16 + pcols[None, :], packed, mask=mask)
    tl.store(scale_ptr + g, scale.to(tl.uint8), mask=gmask)


@triton.jit
def _codes(mag, neg, s, NEG_ZERO_FIELD: tl.constexpr):
    """4-bit codes of |x| bits `mag` (sign `neg`) in blocks of scale exponent `s` (broadcastable
    against the elements). A binary search over the 7 decision points (0.25, 0.75, 1.25, 1.75, 2.5,
    3.5, 5 times 2^s): 3 compares and 4 selects per element instead of 7 compares and 7 adds; the
    points are per-block values."""
    hi = mag > _point(s, 127, 0x600000, 1)  # 1.75: code >= 4
    mid = mag > tl.where(hi, _point(s, 128, 0x600000, 1), _point(s, 126, 0x400000, 1))  # 3.5 | 0.75
    low_pt = tl.where(
        hi,
        tl.where(mid, _point(s, 129, 0x200000, 0), _point(s, 128, 0x200000, 0)),  # 5 | 2.5
        tl.where(mid, _point(s, 127, 0x200000, 0), _point(s, 125, 0x000000, 0)),  # 1.25 | 0.25
    )
    code = hi.to(tl.int32) * 4 + mid.to(tl.int32) * 2 + (mag > low_pt).to(tl.int32)
    keeps_sign = neg & (mag > _ldexp_bits(NEG_ZERO_FIELD, 0, s))
    return code | (keeps_sign.to(tl.int32) << 3)


# One packed word of two bf16 elements -> their two codes as one byte, with bf16x2 arithmetic (two
# elements per instruction). See `_bytes_bf16x2` for the algebra; $1 the word, $2 the word's K2 =
# bf16x2 bits of (2^(1-s), 2^(1-s)), $3 the sign threshold pair ((t + 1) * 0x10001).
_BF16X2_ASM = tl.constexpr("""
{
.reg .b32 m, sg, k1, kh, f2, f1, fh, c, c128, c130, c132, c135;
mov.b32 c128, 0x43004300;
mov.b32 c130, 0x43024302;
mov.b32 c132, 0x43044304;
mov.b32 c135, 0x43074307;
and.b32 m, $1, 0x7FFF7FFF;
or.b32 sg, m, 0x80008000;
sub.s32 sg, sg, $3;
and.b32 sg, sg, $1;
and.b32 sg, sg, 0x80008000;
sub.s32 k1, $2, 0x00800080;
sub.s32 kh, k1, 0x00800080;
fma.rn.bf16x2 f2, m, $2, c128;
fma.rn.bf16x2 f1, m, k1, c130;
fma.rn.bf16x2 fh, m, kh, c132;
min.bf16x2 c, f2, f1;
min.bf16x2 fh, fh, c135;
min.bf16x2 c, c, fh;
and.b32 c, c, 0x00070007;
shr.u32 sg, sg, 12;
or.b32 c, c, sg;
shr.u32 sg, c, 12;
or.b32 c, c, sg;
and.b32 $0, c, 0xFF;
}
""")


@triton.jit
def _bytes_bf16x2(w, k2, thr_pair):
    """The packed byte (two codes) of each int32 word `w` of two bf16 elements in blocks of ordinary
    scale (bytes 3..252: 2^(1-s), 2^-s and 2^(-1-s) are normal bf16), by bf16x2 instructions. With
    y = |x| * 2^-s and R round-half-even to an integer, the codec's magnitude code is R(min(2y, y + 2, y/2 + 4)) capped at 7 (the E2M1 grid
    steps by 1/2 below 2, by 1 below 4, by 2 above: a concave piecewise-linear index), and since R
    is monotone that is min(R(2y), R(y + 2), R(y/2 + 4), 7). Each R is one bf16x2 fma of |x| by a
    power of two plus 128 + c: exact product, one rounding, and at 128 the bf16 unit in the last
    place is 1, so the integer lands in the low mantissa bits. The sign rule (|x| > t, t the
    dtype's underflow threshold as bf16 bits) is a 16-bit compare done by one 32-bit subtract
    whose halves cannot borrow. Needs sm_80+ (bf16x2 fma/min). `bytes_bf16x2_emulated` in
    tests/k3core/ops/test_mxfp4.py is this algebra in torch, checked on CPU against the codec for
    every bf16 value at every ordinary scale; the GPU tests run the same data through the kernel."""
    return tl.inline_asm_elementwise(_BF16X2_ASM, "=r,r,r,r", [w, k2, thr_pair],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _point(s, FIELD: tl.constexpr, FRAC: tl.constexpr, TIE_UP: tl.constexpr):
    """Bits of a decision point scaled by 2^s (``s`` broadcastable against the elements), minus 1 ulp
    when ties round up, so that "passes" is always "|x| bits > point" (see spec.MIDPOINTS)."""
    return _ldexp_bits(FIELD, FRAC, s) - TIE_UP


@triton.jit
def _quantize_bf16_kernel(
    words_ptr,  # the bf16 input as int32 words: [n_groups * 16]
    packed_ptr,  # the packed output as int32 words: [n_groups * 4]
    scale_ptr,
    nonfinite_ptr,
    n_groups,
    ROUND_BIAS: tl.constexpr,
    NEG_ZERO_FIELD: tl.constexpr,
    GROUPS: tl.constexpr,
):
    W: tl.constexpr = GROUPS * 4  # output words of this program, 4 per block
    ow = tl.program_id(0).to(tl.int64) * W + tl.arange(0, W)
    wmask = ow < n_groups * 4
    j = tl.arange(0, 4)  # input word within the output word = byte within the output word
    w = tl.load(words_ptr + ow[:, None] * 4 + j[None, :], mask=wmask[:, None], other=0)  # [W, 4]
    lo_bits = w << 16  # element 2k (little-endian low half) as fp32 bits
    hi_bits = w & -65536  # element 2k+1 (0xFFFF0000 as int32)
    lo_mag, hi_mag = lo_bits & 0x7FFFFFFF, hi_bits & 0x7FFFFFFF
    amax = tl.max(tl.reshape(tl.max(tl.maximum(lo_mag, hi_mag), axis=1), (GROUPS, 4)), axis=1)  # [GROUPS]
    field = (amax + ROUND_BIAS) >> 23
    scale = tl.maximum(field - 2, 0)
    nonfinite = amax >= 0x7F800000
    scale = tl.where(nonfinite, 255, scale)  # E8M0 NaN for a block with inf/NaN
    if tl.max(nonfinite.to(tl.int32), axis=0) > 0:
        tl.atomic_max(nonfinite_ptr, 1)
    s = tl.reshape(tl.broadcast_to((scale - 127)[:, None], (GROUPS, 4)), (W,))[:, None]  # per word
    byte = _codes(lo_mag, lo_bits < 0, s, NEG_ZERO_FIELD) | (_codes(hi_mag, hi_bits < 0, s, NEG_ZERO_FIELD) << 4)
    word = tl.sum(byte << (8 * j)[None, :], axis=1)  # 4 bytes, little-endian; disjoint bits
    tl.store(packed_ptr + ow, word, mask=wmask)
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    tl.store(scale_ptr + g, scale.to(tl.uint8), mask=g < n_groups)


@triton.jit
def _quantize_bf16x2_kernel(
    words_ptr,  # the bf16 input as int32 words: [n_groups * 16]
    packed_ptr,  # the packed output as int32 words: [n_groups * 4]
    scale_ptr,
    nonfinite_ptr,
    n_groups,
    ROUND_BIAS: tl.constexpr,
    NEG_ZERO_FIELD: tl.constexpr,
    GROUPS: tl.constexpr,
    ORDINARY_ONLY: tl.constexpr = False,
):
    """bf16 quantize on a [GROUPS, 4, 4] view of the input words (block, output word, input word):
    the block max reduces over the two inner axes and broadcasts back by expand_dims, so no value
    changes layout through shared memory (the words kernel's reshapes do), and codes of blocks with
    ordinary scale bytes (3..252) come from `_bytes_bf16x2`; a program holding any other block
    (tiny, huge or non-finite values) takes `_codes` for all of its blocks. ``ORDINARY_ONLY``
    compiles the first branch alone, for static instruction counts (`benchmarks/mxfp4_sass.py`);
    such a kernel is wrong for other blocks, and `quantize_triton` never launches it."""
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    gmask = g < n_groups
    r = tl.arange(0, 4)  # output word within the block
    j = tl.arange(0, 4)  # input word within the output word = byte within it
    offs = g[:, None, None] * 16 + r[None, :, None] * 4 + j[None, None, :]
    w = tl.load(words_ptr + offs, mask=gmask[:, None, None], other=0)  # [GROUPS, 4, 4]
    lo_bits = w << 16
    hi_bits = w & -65536
    lo_mag, hi_mag = lo_bits & 0x7FFFFFFF, hi_bits & 0x7FFFFFFF
    amax = tl.max(tl.max(tl.maximum(lo_mag, hi_mag), axis=2), axis=1)  # [GROUPS]
    field = (amax + ROUND_BIAS) >> 23
    scale = tl.maximum(field - 2, 0)
    nonfinite = amax >= 0x7F800000
    scale = tl.where(nonfinite, 255, scale)
    s = (scale - 127)[:, None, None]
    # One program-wide reduction on the fast path: a non-finite block (byte 255) is not ordinary.
    # Byte 253 (a finite max >= 1.75 * 2^127 under the compressed-tensors rule) is not either:
    # its 2^(-1-s) is below bf16's normal range.
    ordinary = tl.where(gmask, ((scale >= 3) & (scale <= 252)).to(tl.int32), 1)
    fast = tl.min(ordinary, axis=0)
    if ORDINARY_ONLY:
        fast = 1
    if fast > 0:
        k2 = (128 - s) * 0x00800080  # bf16 bits of 2^(1 - s), twice
        thr = _ldexp_bits(NEG_ZERO_FIELD, 0, s) >> 16  # sign threshold as bf16 bits
        byte = _bytes_bf16x2(w, k2, (thr + 1) * 0x10001)
    else:
        if tl.max(nonfinite.to(tl.int32), axis=0) > 0:
            tl.atomic_max(nonfinite_ptr, 1)
        byte = _codes(lo_mag, lo_bits < 0, s, NEG_ZERO_FIELD) | (_codes(hi_mag, hi_bits < 0, s, NEG_ZERO_FIELD) << 4)
    word = tl.sum(byte << (8 * j)[None, None, :], axis=2)  # [GROUPS, 4]; disjoint bits
    tl.store(packed_ptr + g[:, None] * 4 + r[None, :], word, mask=gmask[:, None])
    tl.store(scale_ptr + g, scale.to(tl.uint8), mask=gmask)


@triton.jit
def _decode_bits_general(code, s):
    """fp32 bits of the value of 4-bit `code` times 2^s (any s in [-127, 128]; 128 = NaN byte)."""
    m = code & 7
    # |value| = (1 + frac) * 2^(field - 127): 0.5 -> (126, 0); m >= 2 -> (126 + m/2, (m & 1) * 0.5).
    field = tl.where(m >= 2, 126 + (m >> 1), 126)
    frac = tl.where(m >= 2, (m & 1) << 22, 0)
    bits = _ldexp_bits(field, frac, s)
    bits = tl.where(field + s >= 255, 0x7F800000, bits)  # overflow: inf, like the fp32 product
    bits = tl.where(m == 0, 0, bits)
    bits = tl.where(s == 128, 0x7FC00000, bits)  # scale byte 255 (E8M0 NaN)
    return bits | ((code & 8) << 28)


@triton.jit
def _decode_bits_fast(code, k):
    """Same as _decode_bits_general where every product is a normal float or inf (scale bytes
    3..254), with k = 252 + 2s: the bits of m * 2^s for codes m >= 2 are (m + k) << 22, those of
    0.5 * 2^s are k << 22, and (m + k) >= 510 is an overflow to inf."""
    m = code & 7
    t = tl.minimum(m - (m == 1).to(tl.int32) + k, 510)
    bits = tl.where(m == 0, 0, t << 22)
    return bits | ((code & 8) << 28)


@triton.jit
def _mxfp4_dequantize_kernel(
    packed_ptr,
    scale_ptr,
    out_ptr,
    n_groups,
    OUT_KIND: tl.constexpr,  # 0 bf16, 1 fp16, 2 fp32
    GROUPS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    gmask = g < n_groups
    pcols = tl.arange(0, 16)
    p = tl.load(packed_ptr + g[:, None] * 16 + pcols[None, :], mask=gmask[:, None], other=0)
    p = p.to(tl.int32)
    byte = tl.load(scale_ptr + g, mask=gmask, other=127).to(tl.int32)
    # Scale bytes 0..2 (subnormal products) and 255 (NaN) need the general decoder; real weights
    # never have them, so a tile takes the cheap one unless one of its blocks does (uniform branch).
    special = ((byte < 3) | (byte == 255)).to(tl.int32)
    if tl.max(special, axis=0) > 0:
        s = (byte - 127)[:, None]
        lo = _decode_bits_general(p & 15, s)
        hi = _decode_bits_general(p >> 4, s)
    else:
        k = (2 * byte - 2)[:, None]  # 252 + 2 * (byte - 127)
        lo = _decode_bits_fast(p & 15, k)
        hi = _decode_bits_fast(p >> 4, k)
    bits = tl.reshape(tl.join(lo, hi), (GROUPS, 32))  # interleave: low nibble first
    if OUT_KIND == 0:
        # Every decoded value fits bf16 exactly (<= 2 significant bits): keep the top half.
        out = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif OUT_KIND == 1:
        out = bits.to(tl.float32, bitcast=True).to(tl.float16)
    else:
        out = bits.to(tl.float32, bitcast=True)
    cols = tl.arange(0, 32)
    tl.store(out_ptr + g[:, None] * 32 + cols[None, :], out, mask=gmask[:, None])


def _has_bf16x2(w: torch.Tensor) -> bool:
    return w.is_cuda and torch.cuda.get_device_capability(w.device) >= (8, 0)


def _auto_kernel(w: torch.Tensor) -> str:
    """bf16 on sm_80+ (bf16x2 instructions): the bf16x2 kernel; bf16 elsewhere (older GPUs, the
    Triton interpreter, which cannot run inline PTX): the words kernel; other dtypes: generic."""
    if w.dtype != torch.bfloat16:
        return "generic"
    if _has_bf16x2(w):
        return AUTO_BF16_KERNEL
    return "words"


def quantize_triton(
    w: torch.Tensor,
    *,
    scale_rule: str = "compressed-tensors",
    name: str | None = None,
    check_finite: bool = True,
    kernel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of `quantize`; same contract. A non-contiguous w is copied first.

    The finite check reads back one flag (a host sync). `check_finite=False` skips that read
    (blocks with inf/NaN then silently carry scale byte 255); the benchmark uses it to time the
    kernel alone. `kernel`: "auto" (bf16: "bf16x2" on sm_80+, else "words"; other dtypes:
    "generic"), "generic" (the any-dtype kernel), "words" (bf16: `_quantize_bf16_kernel`)
    or "bf16x2" (bf16 on sm_80+: `_quantize_bf16x2_kernel`). All give the same bytes."""
    spec.check_scale_rule(scale_rule)
    spec.check_quantize_input(w)
    if kernel not in QUANTIZE_KERNELS:
        raise ValueError(f"unknown quantize kernel {kernel!r}; use one of {QUANTIZE_KERNELS}")
    if kernel == "auto":
        kernel = _auto_kernel(w)
    if kernel != "generic" and w.dtype != torch.bfloat16:
        raise ValueError(f"the {kernel!r} quantize kernel reads bf16, got {w.dtype}; use kernel='generic'")
    if kernel == "bf16x2" and not _has_bf16x2(w):
        raise ValueError(f"the 'bf16x2' quantize kernel needs a CUDA GPU of compute capability 8.0+ "
                         f"(inline PTX; not the Triton interpreter), got a tensor on {w.device}; use kernel='words'")
    n = w.shape[-1]
    lead = w.shape[:-1]
    packed = torch.empty(*lead, n // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(*lead, n // spec.BLOCK, dtype=torch.uint8, device=w.device)
    n_groups = scale.numel()
    if n_groups == 0:
        return packed, scale
    x = w.contiguous()
    nonfinite = torch.zeros(1, dtype=torch.int32, device=w.device)
    if kernel != "generic":
        bf16_kernel = _quantize_bf16_kernel if kernel == "words" else _quantize_bf16x2_kernel
        bf16_kernel[(triton.cdiv(n_groups, BF16_QUANT_GROUPS),)](
            x.view(torch.int32),
            packed.view(torch.int32),
            scale,
            nonfinite,
            n_groups,
            ROUND_BIAS=spec.ROUND_BIAS[scale_rule],
            NEG_ZERO_FIELD=spec.NEG_ZERO_FIELD[w.dtype],
            GROUPS=BF16_QUANT_GROUPS,
            num_warps=BF16_QUANT_WARPS,
        )
    else:
        _mxfp4_quantize_kernel[(triton.cdiv(n_groups, QUANT_GROUPS),)](
            x,
            packed,
            scale,
            nonfinite,
            n_groups,
            ROUND_BIAS=spec.ROUND_BIAS[scale_rule],
            NEG_ZERO_FIELD=spec.NEG_ZERO_FIELD[w.dtype],
            IS_BF16=w.dtype == torch.bfloat16,
            GROUPS=QUANT_GROUPS,
            num_warps=QUANT_WARPS,
        )
    if check_finite and int(nonfinite.item()):
        spec.raise_non_finite(w, name)
    return packed, scale


_OUT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def dequantize_triton(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Triton path of `dequantize`; same contract."""
    spec.check_dequantize_input(packed, scale, dtype)
    lead, n = packed.shape[:-1], packed.shape[-1] * 2
    out = torch.empty(*lead, n, dtype=dtype, device=packed.device)
    n_groups = scale.numel()
    if n_groups == 0:
        return out
    grid = (triton.cdiv(n_groups, DEQUANT_GROUPS),)
    _mxfp4_dequantize_kernel[grid](
        packed.contiguous(),
        scale.contiguous(),
        out,
        n_groups,
        OUT_KIND=_OUT_KIND[dtype],
        GROUPS=DEQUANT_GROUPS,
        num_warps=DEQUANT_WARPS,
    )
    return out
