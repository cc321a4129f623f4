"""MXFP4 codec: hand-computed vectors, the scalar reference, compressed-tensors bit for bit, Triton.

References: `k3core/ops/mxfp4/naive.py` (scalar, from the spec) and, when importable, the
compressed-tensors 0.20.0 compressor the release's format string selects (test dependency:
`pip install --no-deps compressed-tensors==0.20.0 loguru psutil`; skipped without it).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from k3core.ops import mxfp4
from k3core.ops.mxfp4 import codec_torch, dequantize, dequantize_torch, fake_quantize, quantize, quantize_torch
from k3core.ops.mxfp4.naive import dequantize_reference, quantize_reference
from k3core.ops.mxfp4.spec import NEG_ZERO_FIELD

RULES = ("compressed-tensors", "ocp")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (tells -0.0 from 0.0); any NaN matches any NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    same = a.view(INT_VIEW[a.dtype]) == b.view(INT_VIEW[b.dtype])
    return bool((same | (a.isnan() & b.isnan())).all())


def codes_of(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> codes [..., n], low nibble first."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def one_block(values, dtype=torch.float32) -> torch.Tensor:
    """A [1, 32] block: `values` first, zeros after."""
    w = torch.zeros(1, 32, dtype=torch.float64)
    w[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return w.to(dtype)


def quantize_one(values, dtype=torch.float32, scale_rule="compressed-tensors"):
    packed, scale = quantize(one_block(values, dtype), scale_rule=scale_rule)
    return codes_of(packed)[0, : len(values)].tolist(), int(scale[0, 0])


def mixed_weights(rows: int, cols: int, dtype: torch.dtype, seed: int, exp_range=(-140, 120)):
    """Gaussian blocks scaled by random powers of two across the float range, plus special blocks:
    all-zero, all -0.0, scattered -0.0, tiny negatives, subnormals, exact powers of two and block
    maxima just below / at the 1.75 rounding threshold."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = exp_range
    if dtype == torch.float16:
        lo, hi = -30, 12
    blocks = cols // 32
    exps = torch.randint(lo, hi, (rows, blocks, 1), generator=g).double()
    w = (torch.randn(rows, blocks, 32, generator=g, dtype=torch.float64) * torch.exp2(exps)).reshape(rows, cols)
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    w[2, 3::7] = -0.0
    w[3, :32] = torch.randn(32, generator=g, dtype=torch.float64) * 1e-3
    w[3, 0] = 40.0  # tiny negatives next to a large maximum: signed zeros
    if rows > 8:
        w[4, :32] = torch.randn(32, generator=g, dtype=torch.float64) * 2.0**-130  # subnormal fp32
        w[5, :32] = 2.0 ** torch.randint(-12, 12, (32,), generator=g).double()  # powers of two
        w[6, :32] = torch.linspace(-1.7421875, 1.7421875, 32, dtype=torch.float64)  # max just below 1.75
        w[7, :32] = torch.linspace(-1.75, 1.75, 32, dtype=torch.float64)  # max at 1.75
    return w.to(dtype)


# --- the 16 codes and hand-computed vectors -------------------------------------------------


def test_all_16_codes_decode_and_round_trip():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # one block: codes 0..15 twice
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 16)
    scale = torch.tensor([[127]], dtype=torch.uint8)  # scale 1
    for dtype in DTYPES:
        values = dequantize(packed, scale, dtype=dtype)
        expected = torch.tensor(
            [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0] * 2,
            dtype=dtype,
        ).reshape(1, 32)
        assert bits_equal(values, expected)
        packed2, scale2 = quantize(values)
        assert int(scale2) == 127
        # Every code survives; the one exception is -0.0 (code 8), which the library encodes as +0.
        back = codes_of(packed2)[0]
        assert back.tolist() == [0 if c == 8 else c for c in codes.tolist()]


def test_element_ties_round_to_even():
    # Block max 4.0 is a power of two: exponent 2 - 2 = 0, scale byte 127, scale 1, y = x.
    values = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    codes, scale = quantize_one(values)
    assert scale == 127
    #         4.0 0.25->0 0.75->1 1.25->1 1.75->2 2.5->2 3.5->4 5.0->4
    assert codes == [6, 0, 2, 2, 4, 4, 6, 6]
    # Just off the ties (representable in fp32): to the nearer value.
    nudge = [4.0, 0.2500001, 0.7499999, 1.2500001, 1.7499999, 2.5000002, 3.4999998, 5.0000005]
    codes, _ = quantize_one(nudge)
    assert codes == [6, 1, 1, 3, 3, 5, 5, 7]
    codes, _ = quantize_one([-v for v in values])
    assert codes == [14, 8, 10, 10, 12, 12, 14, 14]  # -0.25 rounds to -0: code 8


def test_scale_rule_power_of_two_and_175_threshold():
    # Exactly a power of two: A = 1 -> exponent 0 - 2 = -2 -> byte 125, y = 4 (code 6).
    assert quantize_one([1.0]) == ([6], 125)
    assert quantize_one([2.0**-100]) == ([6], 127 - 102)
    # bf16 just below 1.75 (1.7421875): rounds down, scale 0.25, y = 6.97 saturates to 6.
    assert quantize_one([1.7421875], torch.bfloat16) == ([7], 125)
    # At 1.75 the library rounds the max up to 2: scale 0.5, y = 3.5 -> tie -> 4.0 (code 6).
    assert quantize_one([1.75], torch.bfloat16) == ([6], 126)
    assert quantize_one([-1.75, 1.0], torch.float32) == ([14, 4], 126)
    # The OCP floor rule keeps 2^0 for both and saturates 7.0 -> 6.
    assert quantize_one([1.7421875], torch.bfloat16, "ocp") == ([7], 125)
    assert quantize_one([1.75], torch.bfloat16, "ocp") == ([7], 125)
    assert quantize_one([1.99], torch.float32, "ocp") == ([7], 125)
    assert quantize_one([1.99], torch.float32) == ([6], 126)


def test_zero_and_negative_zero_blocks():
    assert quantize_one([0.0] * 32) == ([0] * 32, 0)
    assert quantize_one([-0.0] * 32) == ([0] * 32, 0)  # -0.0 encodes as +0 (library semantics)
    # A small negative element rounds to zero but keeps its sign: code 8.
    codes, scale = quantize_one([6.0, -0.1, -0.0, 0.1], torch.bfloat16)
    assert scale == 127 and codes == [7, 8, 0, 0]


def test_signed_zero_underflow_in_input_dtype():
    # The library divides in the input dtype: x / scale underflowing to -0.0 loses the sign.
    # bf16: |y| <= 2^-134 underflows; block max 2^100 -> scale 2^98.
    codes, scale = quantize_one([2.0**100, -(2.0**-36), -1.5 * 2.0**-36], torch.bfloat16)
    assert scale == 225 and codes == [6, 0, 8]
    # fp32: |y| <= 2^-150 underflows; block max 2^120 -> scale 2^118.
    codes, scale = quantize_one([2.0**120, -(2.0**-32), -1.5 * 2.0**-32], torch.float32)
    assert scale == 245 and codes == [6, 0, 8]


def test_subnormal_range_blocks():
    # A = 2^-125: exponent -127 -> byte 0 (scale 2^-127), y = 4.
    assert quantize_one([2.0**-125]) == ([6], 0)
    # A = 1.75 * 2^-126 rounds up to 2^-125: byte 0, y = 3.5 -> 4.0 (code 6).
    assert quantize_one([1.75 * 2.0**-126]) == ([6], 0)
    # A = 2^-126 would want byte -1: clamped to 0, so y = 2 (code 4) instead of 4.
    assert quantize_one([2.0**-126, -(2.0**-127)]) == ([4, 10], 0)
    # Subnormal inputs: A = 3 * 2^-129 -> byte 0, y = 0.75 -> 1.0 (tie to even).
    assert quantize_one([3 * 2.0**-129, 2.0**-149]) == ([2, 0], 0)
    # Below the range: everything rounds to zero under byte 0.
    assert quantize_one([2.0**-140, -(2.0**-145)]) == ([0, 8], 0)


def test_saturation_and_top_of_range():
    # Largest finite floats: A rounds up past 2^127, the rule gives exponent 126 (byte 253).
    big = torch.finfo(torch.float32).max
    codes, scale = quantize_one([big, -big / 4])
    assert scale == 253 and codes == [6, 10]  # y = 3.99999976 -> 4, -0.99999994 -> -1
    assert quantize_one([1.5 * 2.0**127]) == ([7], 252)  # mantissa 1.5 stays: y = 6
    # Decoding at the top: 6 * 2^127 overflows to inf; byte 255 (E8M0 NaN) decodes to NaN.
    packed = torch.tensor([[0x57] + [0] * 15], dtype=torch.uint8)  # codes 7, 5
    out = dequantize(packed, torch.tensor([[254]], dtype=torch.uint8), dtype=torch.float32)
    assert out[0, 0] == math.inf and out[0, 1] == 3.0 * 2.0**127 and out[0, 2] == 0.0
    assert dequantize(packed, torch.tensor([[255]], dtype=torch.uint8)).isnan().all()


# --- properties and the scalar reference ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_rule", RULES)
def test_matches_scalar_reference(dtype, scale_rule):
    w = mixed_weights(12, 256, dtype, seed=1)
    packed, scale = quantize(w, scale_rule=scale_rule)
    ref_packed, ref_scale = quantize_reference(w, scale_rule=scale_rule)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(packed, ref_packed)
    for out_dtype in DTYPES:
        assert bits_equal(dequantize(packed, scale, out_dtype), dequantize_reference(packed, scale, out_dtype))


def test_dequantize_reference_on_all_bytes_and_scales():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (256, 16), dtype=torch.uint8, generator=g)
    scale = torch.arange(256, dtype=torch.uint8).reshape(256, 1)  # every E8M0 byte, incl. 0 and 255
    for out_dtype in DTYPES:
        assert bits_equal(dequantize(packed, scale, out_dtype), dequantize_reference(packed, scale, out_dtype))


@pytest.mark.parametrize("scale_rule", RULES)
def test_quantize_dequantize_is_idempotent(scale_rule):
    w = mixed_weights(16, 512, torch.bfloat16, seed=3)
    packed, scale = quantize(w, scale_rule=scale_rule)
    for out_dtype in (torch.bfloat16, torch.float32):
        packed2, scale2 = quantize(dequantize(packed, scale, out_dtype), scale_rule=scale_rule)
        assert torch.equal(scale2, scale)
        # Equal code for code, except "-0" (code 8) which decodes to -0.0 and re-encodes as +0.
        codes = codes_of(packed)
        assert torch.equal(codes_of(packed2), torch.where(codes == 8, 0, codes))


def test_shapes_strides_chunks_and_empty(monkeypatch):
    w = mixed_weights(24, 192, torch.bfloat16, seed=4)
    packed, scale = quantize(w)
    # Many small chunks give the same bytes as one.
    monkeypatch.setattr(codec_torch, "CPU_CHUNK_BLOCKS", 5)
    assert torch.equal(quantize(w)[0], packed) and torch.equal(quantize(w)[1], scale)
    assert bits_equal(dequantize(packed, scale), dequantize_reference(packed, scale))
    # Leading dims are batch dims; a transposed (non-contiguous) input quantises its own rows.
    p3, s3 = quantize(w.reshape(2, 12, 192))
    assert p3.shape == (2, 12, 96) and s3.shape == (2, 12, 6)
    assert torch.equal(p3.reshape(24, 96), packed)
    wt = torch.randn(64, 96, dtype=torch.bfloat16).t()  # [96, 64], non-contiguous
    assert not wt.is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(quantize(wt), quantize(wt.contiguous())))
    empty_p, empty_s = quantize(torch.zeros(0, 64))
    assert empty_p.shape == (0, 32) and empty_s.shape == (0, 2)
    assert dequantize(empty_p, empty_s).shape == (0, 64)


def test_fp16_follows_fp32_rule():
    w = mixed_weights(8, 128, torch.float16, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(quantize(w), quantize(w.float())))


# --- compressed-tensors, bit for bit ----------------------------------------------------------


def compressed_tensors_compress(w: torch.Tensor):
    """(weight_packed, weight_scale) from compressed-tensors' own code: the scheme the release's
    config declares, group scales from the library's `compute_dynamic_scales_and_zp` (min/max per
    group, as its observers do), the compressor registered for "mxfp4-pack-quantized"."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    args = QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, dynamic=False,
        scale_dtype=torch.uint8,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    scale, _ = compute_dynamic_scales_and_zp(w, args, module=None)
    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    out = compressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return out["weight_packed"], out["weight_scale"], compressor, scheme


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_bit_exact_against_compressed_tensors(dtype):
    w = mixed_weights(64, 1024, dtype, seed=10)
    lib_packed, lib_scale, compressor, scheme = compressed_tensors_compress(w)
    packed, scale = quantize(w)
    assert lib_scale.dtype == torch.uint8 and lib_packed.dtype == torch.uint8
    assert torch.equal(scale, lib_scale)
    assert torch.equal(packed, lib_packed)
    # And decoding: the library's decompress (bf16 output) against ours.
    lib_w = compressor.decompress({"weight_packed": lib_packed, "weight_scale": lib_scale}, scheme)["weight"]
    assert bits_equal(dequantize(packed, scale, lib_w.dtype), lib_w)


def test_bit_exact_against_compressed_tensors_weight_like():
    # Release-like: bf16 Gaussian expert weight of std 0.02, shape of a w2 slice.
    g = torch.Generator().manual_seed(12)
    w = (torch.randn(128, 3584, generator=g) * 0.02).to(torch.bfloat16)
    lib_packed, lib_scale, _, _ = compressed_tensors_compress(w)
    packed, scale = quantize(w)
    assert torch.equal(scale, lib_scale) and torch.equal(packed, lib_packed)


# --- errors and fake quantisation -------------------------------------------------------------


def test_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.tensor(1.0))
    for bad in (torch.zeros(2, 32, dtype=torch.float64), torch.zeros(2, 32, dtype=torch.int32)):
        with pytest.raises(ValueError, match="dtype"):
            quantize(bad)
    with pytest.raises(ValueError, match="scale_rule"):
        quantize(torch.zeros(2, 32), scale_rule="floor")
    w = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    w[2, 1, 40] = float("nan")
    w[2, 3, 0] = float("inf")
    with pytest.raises(ValueError, match=r"'experts\.0\.w1'.*nan at index \(2, 1, 40\)"):
        quantize(w, name="experts.0.w1")
    w[2, 1, 40] = 1.0
    with pytest.raises(ValueError, match=r"inf at index \(2, 3, 0\)"):
        quantize(w)
    packed, scale = quantize(torch.randn(2, 64))
    with pytest.raises(ValueError, match="packed must be uint8.*int8"):
        dequantize(packed.view(torch.int8), scale)
    with pytest.raises(ValueError, match="scale must be uint8"):
        dequantize(packed, scale.float())
    with pytest.raises(ValueError, match="do not match"):
        dequantize(packed[:, :16], scale)
    with pytest.raises(ValueError, match="do not match"):
        dequantize(packed, scale[:1])
    with pytest.raises(ValueError, match="dtype"):
        dequantize(packed, scale, dtype=torch.int32)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_fake_quantize_forward_and_straight_through_gradient(dtype):
    w = mixed_weights(8, 128, dtype, seed=6).requires_grad_(True)
    out = fake_quantize(w)
    assert out.dtype == dtype and out.requires_grad
    assert bits_equal(out.detach(), dequantize(*quantize(w.detach()), dtype=dtype))
    grad = torch.randn(8, 128, dtype=dtype)
    out.backward(grad)
    assert bits_equal(w.grad, grad)
    out_ocp = fake_quantize(w.detach(), scale_rule="ocp")
    assert bits_equal(out_ocp, dequantize(*quantize(w.detach(), scale_rule="ocp"), dtype=dtype))


# --- Triton ------------------------------------------------------------------------------------


def _triton_vs_torch(device: str):
    from k3core.ops.mxfp4.codec_triton import dequantize_triton, quantize_triton

    # bf16 reaches the generic (any-dtype) kernel and the other bf16 kernel only when asked; the
    # interpreter cannot run bf16x2's inline PTX ("auto" picks words there)
    kernels = ["generic"] + (["words", "bf16x2"] if device == "cuda" else [])
    for dtype, kernel in [(d, "auto") for d in DTYPES] + [(torch.bfloat16, k) for k in kernels]:
        w = mixed_weights(67, 640, dtype, seed=7).to(device)  # 67 * 20 blocks: a partial program
        for rule in RULES:
            p_ref, s_ref = quantize_torch(w, scale_rule=rule)
            p, s = quantize_triton(w, scale_rule=rule, kernel=kernel)
            assert torch.equal(p, p_ref) and torch.equal(s, s_ref), (dtype, rule, kernel)
            # ordinary scale bytes only: the kernels' fast decode branch
            assert bits_equal(dequantize_triton(p, s, dtype), dequantize_torch(p, s, dtype))
        # Every scale byte (0 and 255 included) and random codes, to every output dtype.
        packed = torch.randint(0, 256, (256, 64), dtype=torch.uint8, device=device)
        scale = torch.arange(256, dtype=torch.uint8, device=device).reshape(256, 1).repeat(1, 4)
        assert bits_equal(dequantize_triton(packed, scale, dtype), dequantize_torch(packed, scale, dtype))
    if device == "cpu":  # the interpreter: bf16x2 is inline PTX
        with pytest.raises(ValueError, match="compute capability 8.0"):
            quantize_triton(torch.ones(2, 64, dtype=torch.bfloat16), kernel="bf16x2")
    big = mixed_weights(4, 128, torch.float32, seed=8).to(device)
    big[0, :32] = torch.finfo(torch.float32).max
    assert all(torch.equal(a, b) for a, b in zip(quantize_triton(big), quantize_torch(big)))
    for dtype in (torch.float32, torch.bfloat16):
        bad = torch.zeros(5, 64, device=device, dtype=dtype)
        bad[4, 33] = float("nan")
        with pytest.raises(ValueError, match=r"'x'.*index \(4, 33\)"):
            quantize_triton(bad, name="x")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter run (TRITON_INTERPRET=1)"
)
def test_triton_interpreter_matches_torch_path():
    pytest.importorskip("triton")
    _triton_vs_torch("cpu")


def ordinary_scale_bf16(blocks: int, seed: int) -> torch.Tensor:
    """bf16 blocks whose scale bytes are all ordinary (3..252), so the bf16x2 kernel's fast branch
    takes every program: per block a random power of two 2^e, a maximum in [4, 8) * 2^e (saturating
    values above 6 included), every decision point t * 2^e (ties) and its bf16 neighbours, every
    code value, random values in [0, 8) * 2^e, random signs, and tiny (subnormal) values whose sign
    the codec keeps or drops."""
    g = torch.Generator().manual_seed(seed)
    points = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    ties = points.to(torch.bfloat16)
    up = (ties.view(torch.int16) + 1).view(torch.bfloat16).double()
    down = (ties.view(torch.int16) - 1).view(torch.bfloat16).double()
    pool = torch.cat([points, up, down, torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, 7.96875], dtype=torch.float64)])
    pick = pool[torch.randint(0, len(pool), (blocks, 32), generator=g)]
    pick = torch.where(torch.rand(blocks, 32, generator=g) < 0.3, torch.rand(blocks, 32, generator=g, dtype=torch.float64) * 8, pick)
    pick[:, 0] = 4 + 4 * torch.rand(blocks, generator=g, dtype=torch.float64)  # the block maximum
    exps = torch.randint(-100, 100, (blocks, 1), generator=g).double()
    w = pick * torch.exp2(exps) * torch.where(torch.rand(blocks, 32, generator=g) < 0.5, -1.0, 1.0)
    w[:, 31] = -(2.0 ** torch.randint(-133, -127, (blocks,), generator=g).double())  # bf16 subnormals
    return w.to(torch.bfloat16)


def every_bf16_in_ordinary_blocks(rule: str, scales=range(3 - 127, 253 - 127)) -> torch.Tensor:
    """bf16 [B, 32]: for every scale exponent s in `scales` (default: the ordinary scale bytes
    3..252), blocks led by 6 * 2^s (so the block's scale is s under both rules) holding every bf16
    magnitude up to that maximum, ties and subnormals included, with both signs: ~8M elements."""
    blocks = []
    for s in scales:
        lead_value = min(6.0 * 2.0**s, 1.75 * 2.0**127)  # byte 253: a max of 1.75 * 2^127 (rule-dependent)
        top = torch.tensor(lead_value, dtype=torch.bfloat16).view(torch.int16).item()
        mags = torch.arange(0, top + 1, dtype=torch.int32)
        vals = torch.cat([mags, mags | 0x8000]).to(torch.int16).view(torch.bfloat16)
        vals = torch.cat([vals, vals[: (-len(vals)) % 31]])  # whole blocks of 31
        lead = torch.full((len(vals) // 31, 1), lead_value, dtype=torch.bfloat16)
        blocks.append(torch.cat([lead, vals.reshape(-1, 31)], dim=1))
    return torch.cat(blocks)


def bytes_bf16x2_emulated(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bf16x2 kernel's algebra (`codec_triton._bytes_bf16x2`) in torch, instruction by
    instruction on int32 words of two bf16, the fma.rn.bf16x2 rounding done exactly in float64:
    bf16 [B, 32] and their scale bytes [B, 1] -> packed bytes [B, 16]."""
    words = w.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [B, 16], unsigned
    s = scale.long() - 127  # [B, 1]
    k2 = (128 - s) * 0x00800080  # the kernel's multipliers, as bf16x2 bit pairs
    multipliers = (k2, k2 - 0x00800080, k2 - 2 * 0x00800080)  # 2^(1-s), 2^-s, 2^(-1-s)
    thr = codec_torch._ldexp_bits(NEG_ZERO_FIELD[torch.bfloat16], 0, s.int()).long() >> 16
    m = words & 0x7FFF7FFF
    sign = ((m | 0x80008000) - (thr + 1) * 0x10001) & words & 0x80008000

    def bf16(bits16: torch.Tensor) -> torch.Tensor:
        return (bits16.int() << 16).view(torch.float32).double()

    def half_codes(shift: int) -> torch.Tensor:  # min(R(|x| K2 + 0), R(|x| K1 + 2), R(|x| KH + 4), 7)
        x = bf16((m >> shift) & 0xFFFF)
        out = torch.full_like(x, 7.0)
        for k, add in zip(multipliers, (0, 2, 4)):
            v = x * bf16((k >> shift) & 0xFFFF) + add  # exact: at most 8 significant bits apart
            out = torch.minimum(out, torch.where(v < 128, torch.round(v), v))  # R = round-half-even
        return out.long()

    c = (half_codes(0) | (half_codes(16) << 16)) | (sign >> 12)
    return ((c | (c >> 12)) & 0xFF).to(torch.uint8)


@pytest.mark.parametrize("rule", RULES)
def test_bf16x2_algebra_matches_the_codec_on_every_bf16_value(rule):
    # The bf16x2 kernel's code rule, emulated on CPU, against the torch codec for every bf16
    # magnitude at every ordinary scale: what the GPU kernel must reproduce bit for bit.
    w = every_bf16_in_ordinary_blocks(rule)
    packed, scale = quantize_torch(w, scale_rule=rule)
    assert int(scale.min()) == 3 and int(scale.max()) == 252
    emulated = bytes_bf16x2_emulated(w, scale)
    bad = (codes_of(emulated) != codes_of(packed)).nonzero()
    assert not len(bad), f"{len(bad)} codes differ, first {bad[0].tolist()}: value {w[bad[0][0], bad[0][1]].item()}"


def test_bf16x2_algebra_fails_at_scale_byte_253():
    # Why the kernel sends byte 253 (a max >= 1.75 * 2^127, compressed-tensors rule) to the exact
    # path: 2^(-1-s) is not a normal bf16 there, and the rule breaks.
    w = every_bf16_in_ordinary_blocks("compressed-tensors", scales=[126])
    packed, scale = quantize_torch(w, scale_rule="compressed-tensors")
    assert int(scale.min()) == int(scale.max()) == 253
    assert not torch.equal(codes_of(bytes_bf16x2_emulated(w, scale)), codes_of(packed))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16x2_kernel_on_every_bf16_value_on_gpu():
    pytest.importorskip("triton")
    from k3core.ops.mxfp4.codec_triton import quantize_triton

    w = ordinary_scale_bf16(1000, seed=11).cuda()  # 8 programs, one partial
    for rule in RULES:
        p_ref, s_ref = quantize_torch(w, scale_rule=rule)
        assert int(s_ref.min()) >= 3 and int(s_ref.max()) <= 252  # the fast branch everywhere
        p, s = quantize_triton(w, scale_rule=rule, kernel="bf16x2")
        assert torch.equal(s, s_ref), rule
        bad = (codes_of(p) != codes_of(p_ref)).nonzero()
        assert not len(bad), f"{rule}: {len(bad)} codes differ, first at {bad[0].tolist()}"
    for rule in RULES:  # every bf16 value at every ordinary scale, and byte 253 (the exact branch)
        w = every_bf16_in_ordinary_blocks(rule, scales=range(3 - 127, 254 - 127))
        p_ref, s_ref = quantize_torch(w, scale_rule=rule)
        p, s = quantize_triton(w.cuda(), scale_rule=rule, kernel="bf16x2")
        assert torch.equal(s.cpu(), s_ref), rule
        bad = (codes_of(p.cpu()) != codes_of(p_ref)).nonzero()
        assert not len(bad), f"{rule}: {len(bad)} codes differ, first {bad[0].tolist()}"
    with pytest.raises(ValueError, match="reads bf16"):
        quantize_triton(w.float().cuda(), kernel="bf16x2")
    with pytest.raises(ValueError, match="unknown quantize kernel"):
        quantize_triton(w.cuda(), kernel="fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_matches_torch_path_on_gpu():
    pytest.importorskip("triton")
    assert mxfp4.triton_available()
    _triton_vs_torch("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_dispatch_matches_cpu_at_release_size():
    # A w1/w3 slice of the release: [3072, 3584] bf16 -> packed [3072, 1792], scale [3072, 112].
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(3072, 3584, generator=g) * 0.02).to(torch.bfloat16)
    packed, scale = quantize(w)
    packed_gpu, scale_gpu = quantize(w.cuda())
    assert packed_gpu.shape == (3072, 1792) and scale_gpu.shape == (3072, 112)
    assert torch.equal(packed_gpu.cpu(), packed) and torch.equal(scale_gpu.cpu(), scale)
    assert bits_equal(dequantize(packed_gpu, scale_gpu).cpu(), dequantize(packed, scale))
    out = fake_quantize(w.cuda().requires_grad_(True))
    assert bits_equal(out.detach().cpu(), dequantize(packed, scale))
