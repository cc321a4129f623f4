"""SiTU-GLU streaming op vs its references.

References: the closed form in fp64 (below, no autograd), `situ_glu_reference` (plain torch,
autograd) in fp32, and `torch.autograd.gradcheck` in fp64. Memory claims are measured: saved
tensors through `saved_tensors_hooks`, peaks through the CPU allocator's profiler events (CPU) or
the CUDA caching allocator (GPU tests).

Tolerance for a result y (any path) against the exact value y*, per element:
    |y - y*| <= rtol * |y*| + 2e-5 * scale + 1e-30 * |grad|
where rtol = 2^-8 (one bf16 rounding) for bf16 outputs and 1e-6 for fp32, `scale` is the
magnitude of the terms the fp32 computation adds (so cancellation in d_gate near a' = 0, and
1 - sigmoid near saturation, are judged against what fp32 can resolve, about 1e-7 * scale), and
the last term covers sigmoid underflowing to 0 where the exact value is below ~1e-38.
The Triton forward for 16-bit outputs uses the SFU's tanh.approx (relative error < 2^-10.9, see
`situ/fused_triton.py`), so its output bound is one bf16 rounding plus 2^-10: `FAST_OUT_RTOL`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from k3core.ops.memory_probe import peak_bytes, saved_tensors
from k3core.ops.situ import (
    BWD_BUFFERS,
    FWD_BUFFERS,
    rows_per_chunk,
    situ_glu,
    situ_glu_reference,
)

BETA, LB = 4.0, 25.0
BF16_RTOL, FP32_RTOL = 2.0**-8, 1e-6
FAST_OUT_RTOL = BF16_RTOL + 2.0**-10
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def closed_form(x: torch.Tensor, grad: torch.Tensor, beta: float = BETA, lb: float = LB):
    """fp64 closed form: (out, d_x, out_scale, dx_scale) for x: [..., 2H], grad: [..., H]."""
    g, u = x.double().chunk(2, dim=-1)
    go = grad.double()
    tg, s, tu = torch.tanh(g / beta), torch.sigmoid(g), torch.tanh(u / lb)
    a, b = beta * tg * s, lb * tu
    d_gate = go * b * ((1 - tg**2) * s + beta * tg * s * (1 - s))
    d_up = go * a * (1 - tu**2)
    gate_scale = go.abs() * b.abs() * s * (1 + beta * tg.abs())
    up_scale = go.abs() * a.abs()
    return a * b, torch.cat([d_gate, d_up], -1), (a * b).abs(), torch.cat([gate_scale, up_scale], -1)


def assert_close_scaled(actual, expected, scale, rtol, grad_abs=None, what=""):
    actual, expected, scale = actual.double(), expected.double(), scale.double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    floor = 1e-30 * (grad_abs.double() if grad_abs is not None else 1.0)
    err = (actual - expected).abs()
    bound = rtol * expected.abs() + 2e-5 * scale + floor
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{what}: |err| {err.flatten()[worst]:.3e} > bound {bound.flatten()[worst]:.3e} "
        f"(actual {actual.flatten()[worst]:.6e}, expected {expected.flatten()[worst]:.6e})"
    )


def run_op(fn, x, grad):
    """Forward and backward of fn at x (a leaf copy), returning (out, d_x)."""
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    (dx,) = torch.autograd.grad(out, x, grad)
    return out.detach(), dx


def check_against_closed_form(fn, x, grad, rtol, out_rtol=None):
    out, dx = run_op(fn, x, grad)
    assert out.dtype == x.dtype and dx.dtype == x.dtype
    assert out.shape == (*x.shape[:-1], x.shape[-1] // 2) and dx.shape == x.shape
    ref_out, ref_dx, out_scale, dx_scale = closed_form(x, grad)
    grad_abs = torch.cat([grad, grad], -1).abs()
    assert_close_scaled(out, ref_out, out_scale, out_rtol or rtol, what="out")
    assert_close_scaled(dx, ref_dx, dx_scale, rtol, grad_abs, what="d_x")


def out_rtol_for(backend, dtype, rtol):
    """The forward's bound: `FAST_OUT_RTOL` for the Triton kernels' 16-bit fast path."""
    return FAST_OUT_RTOL if backend == "triton" and dtype != torch.float32 else rtol


def saturating_input(dtype, device="cpu", rows=4):
    """Rows of gate/up values at and beyond saturation, every gate paired with every up."""
    vals = torch.tensor([-float("inf"), -1e4, -100.0, -60.0, -1.0, 0.0, 1.0, 60.0, 100.0, 1e4, float("inf")])
    gate, up = torch.meshgrid(vals, vals, indexing="ij")
    x = torch.cat([gate.reshape(1, -1), up.reshape(1, -1)], -1).repeat(rows, 1)
    return x.to(dtype=dtype, device=device)


# --- values and gradients (CPU, streamed torch path) -------------------------------------


@pytest.mark.parametrize("shape", [(3, 2, 16), (7, 6), (2,)])
def test_gradcheck_fp64(shape):
    torch.manual_seed(0)
    x = (torch.randn(shape, dtype=torch.float64) * 4).requires_grad_()
    # workspace of one byte -> one row per chunk: every chunk boundary is exercised
    assert torch.autograd.gradcheck(lambda t: situ_glu(t, workspace_bytes=1), (x,))
    assert torch.autograd.gradcheck(lambda t: situ_glu(t, 3.0, 7.0), (x,))


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, FP32_RTOL), (torch.bfloat16, BF16_RTOL)])
def test_matches_closed_form_many_chunks(dtype, rtol):
    torch.manual_seed(1)
    R, H = 37, 48  # rows not a multiple of the chunk
    x = (torch.randn(R, 2 * H) * 20).to(dtype)  # spans the saturated regions too
    grad = torch.randn(R, H).to(dtype)
    ws = FWD_BUFFERS * 5 * H * 4  # 5 rows per forward chunk, 3 per backward chunk
    check_against_closed_form(lambda t: situ_glu(t, workspace_bytes=ws), x, grad, rtol)


def test_fp32_matches_reference():
    torch.manual_seed(2)
    x = torch.randn(64, 2 * 96) * 5
    grad = torch.randn(64, 96)
    out, dx = run_op(situ_glu, x, grad)
    ref_out, ref_dx = run_op(situ_glu_reference, x, grad)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)


def test_bf16_at_scale_vs_fp32_reference():
    """bf16 input, 1M outputs: one bf16 rounding of an fp32 result, vs the fp32 reference."""
    torch.manual_seed(3)
    R, H = 16 * 64, 1024
    x = (torch.randn(R, 2 * H) * 4).bfloat16()
    grad = torch.randn(R, H).bfloat16()
    out, dx = run_op(situ_glu, x, grad)
    ref_out, ref_dx = run_op(situ_glu_reference, x.float(), grad.float())  # fp32 all through
    _, _, out_scale, dx_scale = closed_form(x, grad)
    grad_abs = torch.cat([grad, grad], -1).abs()
    assert_close_scaled(out, ref_out, out_scale, FAST_OUT_RTOL, what="out vs fp32 reference")
    assert_close_scaled(dx, ref_dx, dx_scale, BF16_RTOL, grad_abs, what="d_x vs fp32 reference")
    # and the bf16 reference (rounds once more, in the cast of its fp32 result) agrees to 1 ulp
    ref_out_bf16, _ = run_op(situ_glu_reference, x, grad)
    assert_close_scaled(out, ref_out_bf16.float(), out_scale, 2 * BF16_RTOL, what="out vs bf16 ref")


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, FP32_RTOL), (torch.bfloat16, BF16_RTOL)])
def test_saturating_inputs_finite_and_exact(dtype, rtol):
    x = saturating_input(dtype)
    grad = torch.linspace(-3, 3, x.shape[-1] // 2).expand(x.shape[0], -1).to(dtype)
    check_against_closed_form(lambda t: situ_glu(t, workspace_bytes=1), x, grad, rtol)
    # the saturated ends really are saturated: a -> beta or 0, d_x -> 0 at +-1e4
    out = situ_glu(x)
    assert out.abs().max() <= BETA * LB


def test_leading_shapes_noncontiguous_and_expanded_grad():
    torch.manual_seed(4)
    base = torch.randn(6, 2 * 32, 5, dtype=torch.float64) * 6
    x = base.transpose(1, 2)  # [6, 5, 64], not contiguous
    assert not x.is_contiguous()
    grad = torch.randn(5, 32, dtype=torch.float64).expand(6, 5, 32)  # stride-0 leading dim
    check_against_closed_form(situ_glu, x, grad, 1e-12)  # run_op's clone keeps the strides
    # .sum() backward hands the op a fully expanded (all stride-0) gradient
    leaf = x.detach().clone().requires_grad_()
    situ_glu(leaf).sum().backward()
    _, ref_dx, _, _ = closed_form(x, torch.ones(6, 5, 32, dtype=torch.float64))
    torch.testing.assert_close(leaf.grad, ref_dx, rtol=1e-12, atol=1e-12)


def test_empty_rows_and_grad_off():
    for shape in [(0, 64), (2, 0, 64)]:
        x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
        out = situ_glu(x)
        assert out.shape == (*shape[:-1], 32) and out.dtype == torch.bfloat16
        out.sum().backward()
        assert x.grad.shape == x.shape
    x = torch.randn(4, 64)
    out, report = saved_tensors(lambda: situ_glu(x))  # requires_grad off
    assert out.grad_fn is None and report.saves == []
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        out, report = saved_tensors(lambda: situ_glu(xg))
    assert out.grad_fn is None and report.saves == []
    torch.testing.assert_close(out, situ_glu_reference(x))


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        situ_glu(torch.randn(4, 7))
    with pytest.raises(ValueError):
        situ_glu(torch.randn(4, 0))
    with pytest.raises(TypeError):
        situ_glu(torch.ones(4, 8, dtype=torch.int32))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            situ_glu(torch.randn(4, 8), backend="triton")


# --- memory: what is saved, and the peak ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_saved_bytes_exactly_the_input(dtype):
    R, H = 16 * 8, 64
    x = torch.randn(R, 2 * H).to(dtype).requires_grad_()
    _, ours = saved_tensors(lambda: situ_glu(x))
    assert ours.saves == [((R, 2 * H), dtype)]
    assert ours.bytes == x.numel() * x.element_size()
    # non-contiguous input: the op saves its one contiguous copy, the same number of bytes
    xt = torch.randn(2 * H, R).to(dtype).t().requires_grad_()
    _, ours_t = saved_tensors(lambda: situ_glu(xt))
    assert ours_t.bytes == xt.numel() * xt.element_size()

    # the naive graph: 7 saves of fp32 [R, H] in 6 storages (sigmoid's result is saved by
    # SigmoidBackward and by the MulBackward of a = (beta * tanh) * sigmoid)
    _, naive = saved_tensors(lambda: situ_glu_reference(x))
    assert naive.saves == [((R, H), torch.float32)] * 7
    assert naive.bytes == 6 * R * H * 4
    if dtype == torch.bfloat16:
        assert naive.bytes == 6 * ours.bytes


def test_peak_memory_bounded_by_workspace_cpu():
    torch.manual_seed(5)
    R, H, ws = 256, 256, 64 * 2**10
    assert R > rows_per_chunk(H, ws, FWD_BUFFERS) and R > rows_per_chunk(H, ws, BWD_BUFFERS)
    x = torch.randn(R, 2 * H).bfloat16().requires_grad_()
    grad = torch.randn(R, H).bfloat16()
    out_bytes, dx_bytes = R * H * 2, R * 2 * H * 2
    slack = 1024  # 0-dim scalars torch allocates for python-number arguments

    out, fwd_peak = peak_bytes(lambda: situ_glu(x, workspace_bytes=ws))
    assert out_bytes <= fwd_peak <= out_bytes + ws + slack
    _, bwd_peak = peak_bytes(lambda: out.backward(grad))
    assert dx_bytes <= bwd_peak <= dx_bytes + ws + slack
    # the same measurement sees the naive graph's six fp32 [R, H] tensors
    _, naive_peak = peak_bytes(lambda: situ_glu_reference(x))
    assert naive_peak >= 6 * R * H * 4 + out_bytes


# --- triton kernels under TRITON_INTERPRET=1 (CPU tensors; wherever triton is installed) -------


@pytest.fixture(scope="module")
def interpreted_kernels():
    """k3core/ops/situ/fused_triton.py loaded afresh with TRITON_INTERPRET=1 (read at @triton.jit time)."""
    pytest.importorskip("triton")
    path = Path(__import__("k3core.ops.situ", fromlist=["x"]).__file__).with_name("fused_triton.py")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("situ_triton_interpreted", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return module


# the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest): one bf16 ulp
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, FP32_RTOL), (torch.bfloat16, 2.0**-7)])
def test_triton_kernels_interpreted(interpreted_kernels, dtype, rtol):
    st = interpreted_kernels
    torch.manual_seed(8)
    cases = [
        ((torch.randn(21, 2 * 40) * 8).to(dtype), (8, 32, 4)),  # masked rows and columns
        (saturating_input(dtype, rows=2), (2, 64, 4)),
    ]
    for x, cfg in cases:
        x[0, :6] = torch.tensor([1e-6, -1e-3, 0.2, -0.3, 0.99, -1.01]).to(dtype)  # series / exp edge
        R, H = x.shape[0], x.shape[1] // 2
        grad = torch.randn(H).to(dtype).expand(R, H)  # stride-0 rows
        check_against_closed_form(
            lambda t: _InterpretedSitu.apply(t, st, cfg), x, grad, rtol
        )


class _InterpretedSitu(torch.autograd.Function):
    """The interpreted kernels behind autograd, to reuse `check_against_closed_form`."""

    @staticmethod
    def forward(ctx, x, st, cfg):
        ctx.save_for_backward(x)
        ctx.st, ctx.cfg = st, cfg
        return st.situ_glu_fwd(x, BETA, LB, cfg)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ctx.st.situ_glu_bwd(x, grad, BETA, LB, ctx.cfg), None, None


# --- GPU: triton kernels and the CUDA torch fallback -----------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, FP32_RTOL), (torch.bfloat16, BF16_RTOL)])
@pytest.mark.parametrize("shape", [(16 * 64, 2 * 3072), (3, 5, 2 * 200), (1, 2)])
@pytest.mark.gpu
@requires_cuda
def test_cuda_matches_closed_form(backend, dtype, rtol, shape):
    torch.manual_seed(6)
    x = (torch.randn(shape, device="cuda") * 8).to(dtype)
    grad = torch.randn(*shape[:-1], shape[-1] // 2, device="cuda").to(dtype)
    check_against_closed_form(lambda t: situ_glu(t, backend=backend), x, grad, rtol, out_rtol_for(backend, dtype, rtol))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, FP32_RTOL), (torch.bfloat16, BF16_RTOL)])
@pytest.mark.gpu
@requires_cuda
def test_cuda_saturating_and_strided_grad(backend, dtype, rtol):
    x = saturating_input(dtype, "cuda")
    grad = torch.linspace(-3, 3, x.shape[-1] // 2, device="cuda").expand(x.shape[0], -1).to(dtype)
    check_against_closed_form(lambda t: situ_glu(t, backend=backend), x, grad, rtol, out_rtol_for(backend, dtype, rtol))
    xb = (torch.randn(2048, 2 * 384, device="cuda") * 8).to(dtype)
    leaf = xb.clone().requires_grad_()
    situ_glu(leaf, backend=backend).sum().backward()  # all-stride-0 gradient
    _, ref_dx, _, dx_scale = closed_form(xb, torch.ones(2048, 384, device="cuda"))
    assert_close_scaled(leaf.grad, ref_dx, dx_scale, rtol, what="d_x, expanded grad")


@pytest.mark.gpu
@requires_cuda
def test_cuda_bf16_vs_fp32_reference():
    torch.manual_seed(7)
    x = (torch.randn(16 * 512, 2 * 3072, device="cuda") * 4).bfloat16()
    grad = torch.randn(16 * 512, 3072, device="cuda").bfloat16()
    out, dx = run_op(situ_glu, x, grad)
    ref_out, ref_dx = run_op(situ_glu_reference, x.float(), grad.float())
    _, _, out_scale, dx_scale = closed_form(x, grad)
    grad_abs = torch.cat([grad, grad], -1).abs()
    assert_close_scaled(out, ref_out, out_scale, FAST_OUT_RTOL, what="out vs fp32 reference")
    assert_close_scaled(dx, ref_dx, dx_scale, BF16_RTOL, grad_abs, what="d_x vs fp32 reference")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.gpu
@requires_cuda
def test_cuda_memory(backend):
    R, H, ws = 16 * 1024, 3072, 8 * 2**20
    x = torch.randn(R, 2 * H, device="cuda").bfloat16().requires_grad_()
    grad = torch.randn(R, H, device="cuda").bfloat16()
    _, saved = saved_tensors(lambda: situ_glu(x, backend=backend))
    assert saved.bytes == x.numel() * x.element_size()
    extra = ws if backend == "torch" else 0
    slack = 2**20  # allocator rounding, scalars
    out, fwd_peak = peak_bytes(lambda: situ_glu(x, backend=backend, workspace_bytes=ws), "cuda")
    assert fwd_peak <= R * H * 2 + extra + slack
    _, bwd_peak = peak_bytes(lambda: out.backward(grad), "cuda")
    assert bwd_peak <= R * 2 * H * 2 + extra + slack
    empty = torch.empty(0, 2 * H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    situ_glu(empty, backend=backend).sum().backward()
    assert empty.grad.shape == empty.shape
