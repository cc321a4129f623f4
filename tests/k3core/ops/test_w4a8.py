"""W4A8 matmuls: FP8 E4M3 activation quantisation against a scalar reference written from the format's
definition, and the expert matmuls against a plain fp64 dequantise-then-multiply reference."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from k3core.ops import mxfp4
from k3core.ops.w4a8 import (FP8_MAX, dequantize_fp8, fp8_e4m3_values, quantize_fp8,
                             quantize_fp8_reference, round_to_e4m3_reference, w4a8_grouped_mm, w4a8_linear,
                             w4a8_reference)


def test_reference_e4m3_table_is_torchs_float8_e4m3fn():
    """The 127 non-negative finite codes, decoded from the definition, are torch's dtype values."""
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert codes.float().tolist() == fp8_e4m3_values()
    assert max(fp8_e4m3_values()) == FP8_MAX == torch.finfo(torch.float8_e4m3fn).max


def _activations(g):
    x = torch.randn(6, 96, generator=g) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[1] = 0.0  # an all-zero token / blocks
    x[2, :32] = 2.0**-140  # a block below every scale (fp32 subnormal)
    x[3, 5] = 448.0 * 4  # a block max exactly 448 * 2^2: fits, no saturation
    x[3, 40] = 448.0 * 4 * (1 + 2**-20)  # just above: the next power of two
    x[4, :] = torch.tensor([0.5, 1.5, 2.5]).repeat(32)  # ties
    return x


@pytest.mark.parametrize("granularity", ["token", "block32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_matches_scalar_reference(granularity, dtype):
    g = torch.Generator().manual_seed(0)
    x = _activations(g).to(dtype)
    q, s = quantize_fp8(x, granularity)
    values, scales = quantize_fp8_reference(x, granularity)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.double(), values)
    got_scales = s.double() if granularity == "token" else 2.0 ** (s.double() - 127)
    want = scales[..., :1] if granularity == "token" else scales[..., ::32]
    assert torch.equal(got_scales.expand_as(want), want)


def test_scale_rules_never_saturate_and_hit_448():
    x = torch.tensor([[3.0, -7.0, 0.25] + [0.0] * 29, [448.0 * 4] + [1.0] * 31, [448.0 * 4 * 1.0001] + [0.0] * 31])
    q, s = quantize_fp8(x, "token")
    assert q[0, 1].item() == -448.0 and q[1, 0].item() == 448.0 and q[2, 0].item() == 448.0
    assert abs(q.float()).max() == FP8_MAX
    qb, sb = quantize_fp8(x, "block32")
    assert sb[:, 0].tolist() == [127 - 6, 127 + 2, 127 + 3]  # 7 <= 448 * 2^-6; 1792 = 448 * 2^2 exactly
    assert qb[1, 0].item() == 448.0 and qb[2, 0].item() == round_to_e4m3_reference(448.0 * 1.0001 / 2)
    # the quantised value before the cast can exceed 448 by a rounding step: the clamp, not torch's
    # cast (saturating in some versions, NaN in others), keeps it finite
    y = torch.tensor([[FP8_MAX * (1 + 2**-23)] * 32])
    assert torch.isfinite(quantize_fp8(y, "token")[0].float()).all()


def test_zero_rows_and_nonfinite_rows():
    x = torch.zeros(2, 64)
    x[1, 3] = float("inf")
    for granularity in ("token", "block32"):
        q, s = quantize_fp8(x, granularity)
        d = dequantize_fp8(q, s)
        assert torch.equal(d[0], torch.zeros(64))
        assert torch.isnan(d[1, :32]).all()  # the bad token / block is visibly broken
    assert torch.equal(dequantize_fp8(*quantize_fp8(x, "block32"))[1, 32:], torch.zeros(32))


def test_fake_quantize_fp8_error_is_within_half_an_e4m3_step():
    """Closed-form bound: E4M3 has 3 mantissa bits, so a normal value is off by at most 2^-4 of itself
    and a subnormal one (below 2^-6 in units of the scale) by at most half the step 2^-9."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 4, 64).unsqueeze(1)
    for granularity in ("token", "block32"):
        q, s = quantize_fp8(x, granularity)
        scale = s if granularity == "token" else (2.0 ** (s.double() - 127)).float().repeat_interleave(32, -1)
        err = (dequantize_fp8(q, s) - x).abs()
        bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * scale.expand_as(x)) * (1 + 1e-6)
        assert err.le(bound).all(), granularity


def _bound(a64, w64):
    """fp32 accumulation bound for a K-term dot product, from the magnitudes of the terms."""
    return 1e-5 * (a64.abs() @ w64.abs().t()) + 1e-30


@pytest.mark.parametrize("granularity", ["token", "block32", None])
def test_w4a8_linear_matches_fp64_reference(granularity):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 96, generator=g) * 3
    w = torch.randn(40, 96, generator=g) * 0.05
    packed, scale = mxfp4.quantize(w)
    got = w4a8_linear(x, packed, scale, granularity).double()
    ref = w4a8_reference(x, packed, scale, granularity)
    a = x.double() if granularity is None else torch.mul(*quantize_fp8_reference(x, granularity))
    assert (got - ref).abs().le(_bound(a, mxfp4.dequantize(packed, scale, torch.float32).double())).all()
    assert w4a8_linear(x.bfloat16(), packed, scale, granularity).dtype == torch.bfloat16


@pytest.mark.parametrize("granularity", ["token", "block32"])
def test_grouped_mm_matches_per_expert_reference(granularity):
    g = torch.Generator().manual_seed(3)
    E, M, K = 4, 48, 64
    counts = torch.tensor([3, 0, 9, 1])
    x = torch.randn(int(counts.sum()), K, generator=g)
    w = torch.randn(E, M, K, generator=g)
    w[2, :, :32] = 0.0  # all-zero MXFP4 blocks
    packed, scale = mxfp4.quantize(w)
    got = w4a8_grouped_mm(x, counts, packed, scale, granularity, out_dtype=torch.float32).double()
    start = 0
    for e, n in enumerate(counts.tolist()):
        ref = w4a8_reference(x[start:start + n], packed[e], scale[e], granularity)
        torch.testing.assert_close(got[start:start + n], ref, rtol=1e-5, atol=1e-5)
        start += n
    assert w4a8_grouped_mm(x[:0], torch.zeros(E, dtype=torch.long), packed, scale, granularity).shape == (0, M)


def test_bad_inputs_are_refused():
    packed, scale = mxfp4.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(torch.randn(2, 64), "tensor")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_fp8(torch.randn(2, 40), "block32")
    with pytest.raises(ValueError, match="K=32"):
        w4a8_linear(torch.randn(2, 32), packed, scale)
    with pytest.raises(ValueError, match="uint8"):
        w4a8_linear(torch.randn(2, 64), packed.to(torch.int16), scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(torch.randn(2, 64), torch.ones(2, 1))


@pytest.mark.parametrize("bn", [16, 64])
def test_device_tiles_are_the_host_tiles_then_spares(bn):
    """The tile table built on the device equals the host-built reference (``_tiles``) row for row,
    over random counts with empty experts, and pads to a size fixed by n and E with empty tiles."""
    pytest.importorskip("triton")  # the module defines its kernel at import; the tables are plain torch
    from k3core.ops.w4a8 import grouped_mm_triton as T

    g = torch.Generator().manual_seed(bn)
    for _ in range(200):
        E = int(torch.randint(1, 12, (1,), generator=g))
        counts = torch.randint(0, 3 * bn, (E,), generator=g) * (torch.rand(E, generator=g) > 0.3)
        n = int(counts.sum())
        ref = T._tiles(counts.tolist(), bn, "cpu")
        got = T.device_tiles(counts, n, bn)
        assert got.dtype == torch.int32 and got.shape == (T.max_tiles(n, E, bn), 3)
        assert torch.equal(got[: ref.shape[0]], ref), (counts, got, ref)
        spare = got[ref.shape[0]:]
        assert (spare[:, 1] == spare[:, 2]).all() and (spare[:, 0] < E).all()
    # the bound's worst cases: one row for each of many experts, and one expert holding every row
    for counts in (torch.ones(40, dtype=torch.int64), torch.tensor([0, 3 * bn + 1, 0])):
        n, E = int(counts.sum()), counts.numel()
        assert T._tiles(counts.tolist(), bn, "cpu").shape[0] <= T.max_tiles(n, E, bn)
    assert T.tile_rows(16 * 64, 64) == 16 and T.tile_rows(16 * 64 + 1, 64) == 64


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed")
def test_fused_kernel_logic_under_the_triton_interpreter():
    """The fused kernel's indexing, masking and decoding, run by TRITON_INTERPRET=1 on the CPU (fp32 dot:
    the interpreter's bf16 dot is unusable); the GPU test below runs it compiled."""
    code = textwrap.dedent("""
        import torch
        from k3core.ops import mxfp4
        from k3core.ops.w4a8 import quantize_fp8, w4a8_grouped_mm
        from k3core.ops.w4a8.grouped_mm_triton import w4a8_grouped_mm_triton
        g = torch.Generator().manual_seed(0)
        counts = torch.tensor([5, 0, 40])
        x = torch.randn(45, 160, generator=g)
        w = torch.randn(3, 96, 160, generator=g)
        w[0, :, :32] = 0
        p, s = mxfp4.quantize(w)
        for gr in ("token", "block32"):
            q, qs = quantize_fp8(x, gr)
            got = w4a8_grouped_mm_triton(q, qs, counts, p, s, torch.float32)
            ref = w4a8_grouped_mm(x, counts, p, s, gr, use_triton=False)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        # every tile shape: K = 160 leaves a partial K step at 64, 128 and 256 inputs; M = 96 a partial
        # output block at 64 and 128
        from k3core.ops.w4a8.grouped_mm_triton import KernelConfig
        # (hw_cvt does not apply here; the scale is gathered per byte or broadcast per block)
        for cfg in (KernelConfig(32, 64, scale_once=False), KernelConfig(64, 128, scale_once=False),
                    KernelConfig(128, 256, scale_once=False), KernelConfig(32, 64), KernelConfig(128, 256)):
            for gr in ("token", "block32"):
                q, qs = quantize_fp8(x, gr)
                got = w4a8_grouped_mm_triton(q, qs, counts, p, s, torch.float32, config=cfg)
                ref = w4a8_grouped_mm(x, counts, p, s, gr, use_triton=False)
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        # every E4M3 code decodes to torch's value (identity weight), NaN codes to NaN
        codes = torch.arange(256, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        finite = codes.view(torch.float8_e4m3fn).reshape(-1, 32)
        eye = mxfp4.quantize(torch.eye(32).unsqueeze(0))
        got = w4a8_grouped_mm_triton(finite, torch.ones(finite.shape[0], 1), torch.tensor([finite.shape[0]]),
                                     *eye, torch.float32)
        assert torch.equal(got, finite.float())
        nan = torch.zeros(2, 32, dtype=torch.uint8)
        nan[0, 3], nan[1, 7] = 0x7F, 0xFF
        got = w4a8_grouped_mm_triton(nan.view(torch.float8_e4m3fn), torch.ones(2, 1), torch.tensor([2]), *eye,
                                     torch.float32)
        assert torch.isnan(got).all()
        # nothing reads the counts on the host (a CUDA graph can capture the call): with tolist and item
        # refused, other counts of the same 45 rows (other tiles, other spares in the fixed-size table) match
        real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item
        for counts in (torch.tensor([15, 15, 15]), torch.tensor([1, 0, 44]), torch.tensor([0, 0, 45])):
            q, qs = quantize_fp8(x, "token")
            ref = w4a8_grouped_mm(x, counts, p, s, "token", use_triton=False)
            def refuse(*a, **k):
                raise AssertionError("a host read of the counts")
            torch.Tensor.tolist, torch.Tensor.item = refuse, refuse
            try:
                got = w4a8_grouped_mm_triton(q, qs, counts, p, s, torch.float32)
            finally:
                torch.Tensor.tolist, torch.Tensor.item = real_tolist, real_item
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


_TOKEN_QUANTIZER_CASES = textwrap.dedent("""
    import torch
    from k3core.ops.w4a8 import fp8_e4m3_values, quantize_fp8
    from k3core.ops.w4a8.fp8_triton import quantize_fp8_token_triton
    dev = "{device}"
    # scale exactly 1 (each row holds 448): every E4M3 value, every midpoint between neighbours
    # (ties: to even) and one fp32 ulp either side, subnormals and what rounds to zero, both signs
    vals = torch.tensor(fp8_e4m3_values(), dtype=torch.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    f32 = torch.cat([vals, mids]).float()
    up, down = torch.nextafter(f32, torch.tensor(1e9)), torch.nextafter(f32, torch.tensor(-1.0))
    grid = torch.cat([f32, up, down.clamp(min=0), torch.tensor([2.0**-10, 2.0**-11, 1e-30, 0.0])])
    grid = torch.cat([grid, -grid])
    pad = (-grid.numel()) % 255
    rows = torch.cat([grid, torch.zeros(pad)]).reshape(-1, 255)
    x_exact = torch.cat([rows, torch.full((rows.shape[0], 1), 448.0)], 1)
    g = torch.Generator().manual_seed(0)
    # row maxima from 1e-32 up: below about 5e-33 an fp32-subnormal element (which GPU kernels flush
    # to zero, and the interpreter's bf16 upcast mangles) could quantise to a nonzero code
    x_rand = torch.randn(64, 300, generator=g) * torch.logspace(-32, 30, 64).unsqueeze(1)
    x_rand[3] = 0
    x_rand[5, 7], x_rand[6, 1], x_rand[8, 2] = float("inf"), float("nan"), -float("inf")
    cases = [(x_exact, torch.float32)] + [(x_rand, dt) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    cases.append((torch.randn(3, 3584, generator=g), torch.bfloat16))  # a row wider than one warp's share
    for x, dt in cases:
        x = x.to(device=dev, dtype=dt)
        q, s = quantize_fp8_token_triton(x)
        qr, sr = quantize_fp8(x, "token")
        assert q.dtype == qr.dtype and s.shape == sr.shape, (q.dtype, s.shape)
        assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(s[~s.isnan()], sr[~sr.isnan()]), dt
        qb, qrb = q.view(torch.uint8), qr.view(torch.uint8)
        nan, nan_ref = (qb & 0x7F) == 0x7F, (qrb & 0x7F) == 0x7F
        assert torch.equal(nan, nan_ref) and torch.equal(qb[~nan], qrb[~nan_ref]), (dt, int((qb != qrb).sum()))
    q, s = quantize_fp8_token_triton(torch.zeros(2, 0, device=dev))
    assert q.shape == (2, 0) and torch.equal(s, quantize_fp8(torch.zeros(2, 0, device=dev), "token")[1])
    print("ok")
""")


@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed")
def test_fused_token_quantizer_equals_the_torch_path_under_the_triton_interpreter():
    """The one-kernel per-token quantiser is ``quantize_fp8(x, "token")`` byte for byte: scales,
    codes at every E4M3 value, midpoint (ties to even) and neighbouring fp32, subnormals, NaN rows."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _TOKEN_QUANTIZER_CASES.format(device="cpu")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_token_quantizer_equals_the_torch_path_on_gpu():
    exec(_TOKEN_QUANTIZER_CASES.format(device="cuda"), {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("granularity", ["token", "block32"])
def test_fused_kernel_matches_torch_path_on_gpu(granularity):
    from k3core.ops.w4a8 import triton_available

    assert triton_available(), "CUDA without triton: the fused kernel cannot run"
    g = torch.Generator(device="cuda").manual_seed(0)
    E, M, K = 8, 512, 384
    counts = torch.tensor([0, 1, 17, 200, 64, 3, 0, 90], device="cuda")
    x = torch.randn(int(counts.sum()), K, device="cuda", generator=g).bfloat16()
    packed, scale = mxfp4.quantize(torch.randn(E, M, K, device="cuda", generator=g) * 0.02)
    got = w4a8_grouped_mm(x, counts, packed, scale, granularity, out_dtype=torch.float32, use_triton=True)
    ref = w4a8_grouped_mm(x, counts, packed, scale, granularity, out_dtype=torch.float32, use_triton=False)
    # same exact products, bf16 tensor cores vs fp32 matmul: only accumulation order differs
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    from k3core.ops.w4a8.grouped_mm_triton import KernelConfig, w4a8_grouped_mm_triton

    q, s = quantize_fp8(x, granularity)
    # the tile shapes, with the default decode (hardware conversion, one scale load per block) and
    # with integer decoding and per-byte scales, each alone and together
    for cfg in (KernelConfig(32, 64, 4, 2), KernelConfig(64, 256, 8, 3), KernelConfig(128, 128, 4, 4),
                KernelConfig(64, 64, hw_cvt=False, scale_once=False), KernelConfig(128, 128, hw_cvt=False),
                KernelConfig(32, 64, scale_once=False), KernelConfig(128, 256, 8, 3, False, False)):
        torch.testing.assert_close(w4a8_grouped_mm_triton(q, s, counts, packed, scale, torch.float32, config=cfg),
                                   ref, rtol=1e-4, atol=1e-4)
