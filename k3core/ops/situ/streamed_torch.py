"""SiTU-GLU: the K3 MLP activation, as a streaming autograd op that saves only its input.

Contract (docs: /work/shared/reference/k3-architecture.md, "SiTU-GLU")::

    x = [gate | up]                       # [..., 2H], split along the last dim
    a = beta * tanh(gate / beta) * sigmoid(gate)
    b = linear_beta * tanh(up / linear_beta)
    out = a * b                           # [..., H]

computed in fp32 (fp64 for fp64 input, so that `gradcheck` can run) and returned in the input
dtype. K3 uses beta = 4.0, linear_beta = 25.0.

Why a custom op: plain autograd through that expression keeps six fp32 [R, H] tensors alive until
backward (tanh(gate/beta), beta*tanh(gate/beta), sigmoid(gate), a, tanh(up/lb), b; see
`situ_glu_reference`), i.e. 24 bytes per output element. With R = tokens x 16 routed experts and
H = 3072 that is more than 100 GB at 100k tokens per GPU. `situ_glu` saves only `x` (4 bytes per
output element in bf16: 1/6 of that) and recomputes tanh/sigmoid in backward.

Paths, all behind one `torch.autograd.Function`:
  * CUDA with triton importable, fp16/bf16/fp32 input: one fused forward kernel and one fused
    backward kernel that writes d_gate and d_up (`fused_triton.py`); no fp32
    temporaries at all.
  * otherwise (CPU, or CUDA without triton): torch ops streamed over row chunks through one
    fixed-size fp32 workspace, so no full-size fp32 temporary ever exists.

This module owns the math and the memory contract; it knows nothing about experts or routing.
The gradient is not written into the saved input's storage: the op cannot prove that nobody else
holds that storage (the caller, another node of the graph, or a second backward under
`retain_graph=True`), so `d_x` is a fresh tensor in the input dtype.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

__all__ = [
    "situ_glu",
    "situ_glu_reference",
    "SituGLUFunction",
    "WORKSPACE_BYTES",
    "CUDA_WORKSPACE_BYTES",
    "FWD_BUFFERS",
    "BWD_BUFFERS",
    "rows_per_chunk",
]

# Upper bound on the fp32 workspace of the streamed torch path (all chunk temporaries together).
# A few MiB keeps a chunk in the CPU's caches; larger on CUDA, where each chunk costs ~15 kernel
# launches and small chunks would be launch-bound. One row is always processed, so a row wider
# than the budget (H > budget / (buffers * 4 bytes)) uses one row's worth instead.
WORKSPACE_BYTES = 4 * 2**20
CUDA_WORKSPACE_BYTES = 64 * 2**20
# Number of [rows, H] fp32 buffers in the workspace of forward and backward.
FWD_BUFFERS = 3
BWD_BUFFERS = 5

Backend = Literal["auto", "torch", "triton"]


def situ_glu_reference(x: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """The plain expression, differentiated by autograd: the reference and the benchmark baseline.

    x: [..., 2H] (gate then up) -> [..., H] in x.dtype, computed in fp32 (fp64 for fp64 input).
    Autograd saves six fp32 [..., H] tensors here: the results of both tanh and of sigmoid (the
    latter twice, one storage), beta*tanh(gate/beta) and a (for a*sigmoid and a*b), and b.
    """
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    gate, up = x.to(compute_dtype).chunk(2, dim=-1)
    a = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    b = linear_beta * torch.tanh(up / linear_beta)
    return (a * b).to(x.dtype)


def rows_per_chunk(hidden: int, workspace_bytes: int, buffers: int, itemsize: int = 4) -> int:
    """Rows of a chunk such that `buffers` [rows, hidden] temporaries fit in `workspace_bytes`."""
    return max(1, workspace_bytes // (buffers * hidden * itemsize))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _workspace(rows: int, hidden: int, buffers: int, x: torch.Tensor, workspace_bytes: int) -> torch.Tensor:
    dtype = _compute_dtype(x.dtype)
    rows = min(rows, rows_per_chunk(hidden, workspace_bytes, buffers, dtype.itemsize))
    return torch.empty(buffers, rows, hidden, dtype=dtype, device=x.device)


def _forward_torch(x2d: torch.Tensor, beta: float, linear_beta: float, workspace_bytes: int) -> torch.Tensor:
    """Streamed forward. x2d: [R, 2H] contiguous -> out: [R, H] in x2d.dtype.

    Every op below writes into the workspace (out= or in place), so the only allocations are `out`
    and the workspace. The op order matches `situ_glu_reference`, so fp32 results agree with it
    to the last bit or so (only vectorised vs scalar loops may differ).
    """
    R, H = x2d.shape[0], x2d.shape[1] // 2
    out = torch.empty(R, H, dtype=x2d.dtype, device=x2d.device)
    if out.numel() == 0:
        return out
    ws = _workspace(R, H, FWD_BUFFERS, x2d, workspace_bytes)
    step = ws.shape[1]
    for r0 in range(0, R, step):
        r1 = min(r0 + step, R)
        g, u, t = ws[0, : r1 - r0], ws[1, : r1 - r0], ws[2, : r1 - r0]
        g.copy_(x2d[r0:r1, :H])
        u.copy_(x2d[r0:r1, H:])
        torch.div(g, beta, out=t).tanh_().mul_(beta)  # beta * tanh(g / beta)
        t.mul_(g.sigmoid_())  # a
        u.div_(linear_beta).tanh_().mul_(linear_beta)  # b
        # (not mul(out=out[r0:r1]): on CPU a dtype-casting out= allocates a temporary)
        out[r0:r1].copy_(t.mul_(u))
    return out


def _backward_torch(
    x2d: torch.Tensor, grad2d: torch.Tensor, beta: float, linear_beta: float, workspace_bytes: int
) -> torch.Tensor:
    """Streamed backward. x2d: [R, 2H] contiguous, grad2d: [R, H] any strides -> d_x [R, 2H].

    With tg = tanh(g/beta), s = sigmoid(g), tu = tanh(u/lb), a = beta*tg*s, b = lb*tu:
        d_up   = grad * a * (1 - tu^2)
        d_gate = grad * b * s * ((1 - tg^2) + beta * tg * (1 - s))
    Every factor is bounded (|tg|, |tu|, s, 1 - s in [0, 1]), so saturated inputs give exact
    zeros or finite values, never inf/NaN.
    """
    R, H = x2d.shape[0], x2d.shape[1] // 2
    dx = torch.empty_like(x2d)
    if dx.numel() == 0:
        return dx
    ws = _workspace(R, H, BWD_BUFFERS, x2d, workspace_bytes)
    step = ws.shape[1]
    for r0 in range(0, R, step):
        r1 = min(r0 + step, R)
        tg, s, tu, go, w = (ws[i, : r1 - r0] for i in range(BWD_BUFFERS))
        s.copy_(x2d[r0:r1, :H])
        torch.div(s, beta, out=tg).tanh_()
        s.sigmoid_()
        tu.copy_(x2d[r0:r1, H:]).div_(linear_beta).tanh_()
        go.copy_(grad2d[r0:r1]).mul_(s)  # grad * s, a factor of both halves
        # d_up = beta * tg * (grad * s) * (1 - tu^2)
        torch.mul(tu, tu, out=w)
        torch.addcmul(go, go, w, value=-1.0, out=w).mul_(tg)
        dx[r0:r1, H:].copy_(w.mul_(beta))
        # d_gate = lb * tu * (grad * s) * (1 - tg^2 + beta * tg * (1 - s)), with the bracket
        # computed as -(tg * (tg + beta * s - beta) - 1) and its sign folded into -lb
        torch.add(tg, s, alpha=beta, out=w).sub_(beta).mul_(tg).sub_(1.0)
        w.mul_(tu).mul_(go)
        dx[r0:r1, :H].copy_(w.mul_(-linear_beta))
    return dx


@functools.cache
def _triton_ops():
    """The triton kernels module, or None where triton is not importable (e.g. CPU-only hosts)."""
    try:
        from k3core.ops.situ import fused_triton as situ_triton
    except ImportError:
        return None
    return situ_triton


def _use_triton(x: torch.Tensor, backend: Backend) -> bool:
    if backend == "torch":
        return False
    ok = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and _triton_ops() is not None
    if backend == "triton" and not ok:
        raise RuntimeError(
            f"situ_glu backend='triton' needs a CUDA fp16/bf16/fp32 tensor and triton installed "
            f"(got device={x.device}, dtype={x.dtype}, triton={'yes' if _triton_ops() else 'no'})"
        )
    return ok


def _forward(x2d, beta, linear_beta, backend, workspace_bytes):
    if _use_triton(x2d, backend):
        return _triton_ops().situ_glu_fwd(x2d, beta, linear_beta)
    return _forward_torch(x2d, beta, linear_beta, workspace_bytes)


def _backward(x2d, grad2d, beta, linear_beta, backend, workspace_bytes):
    if _use_triton(x2d, backend):
        return _triton_ops().situ_glu_bwd(x2d, grad2d, beta, linear_beta)
    return _backward_torch(x2d, grad2d, beta, linear_beta, workspace_bytes)


class SituGLUFunction(torch.autograd.Function):
    """Autograd op on x2d: [R, 2H] contiguous -> [R, H]. Saves x2d and nothing else.

    Not twice differentiable (backward is a fused kernel, not an autograd graph).
    """

    @staticmethod
    def forward(ctx, x2d, beta, linear_beta, backend, workspace_bytes):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x2d)
        ctx.args = (beta, linear_beta, backend, workspace_bytes)
        return _forward(x2d, beta, linear_beta, backend, workspace_bytes)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if grad_out is None:
            return None, None, None, None, None
        (x2d,) = ctx.saved_tensors
        return _backward(x2d, grad_out, *ctx.args), None, None, None, None


def situ_glu(
    x: torch.Tensor,
    beta: float = 4.0,
    linear_beta: float = 25.0,
    *,
    backend: Backend = "auto",
    workspace_bytes: int | None = None,
) -> torch.Tensor:
    """SiTU-GLU of x = [gate | up]. x: [..., 2H] floating, any strides -> [..., H] in x.dtype.

    Same values as `situ_glu_reference` (fp32 math), but autograd saves only `x` (its contiguous
    copy if x is not contiguous: made once, here) and backward returns d_x = [d_gate | d_up] in
    x.dtype. Any leading shape, including zero rows (an expert that got no tokens); with grad off
    or x not requiring grad nothing is saved.

    backend: "auto" (triton on CUDA when importable, else the streamed torch path), "torch", or
    "triton" (raises if unavailable). workspace_bytes: fp32 workspace of the torch path
    (default WORKSPACE_BYTES on CPU, CUDA_WORKSPACE_BYTES on CUDA).
    """
    if not x.is_floating_point():
        raise TypeError(f"situ_glu expects a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"situ_glu expects [..., 2H] with H >= 1, got shape {tuple(x.shape)}")
    if beta <= 0 or linear_beta <= 0:
        raise ValueError(f"situ_glu needs beta > 0 and linear_beta > 0, got {beta}, {linear_beta}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown situ_glu backend {backend!r}")
    if workspace_bytes is None:
        workspace_bytes = CUDA_WORKSPACE_BYTES if x.is_cuda else WORKSPACE_BYTES
    two_h = x.shape[-1]
    x2d = x.contiguous().view(-1, two_h)
    beta, linear_beta = float(beta), float(linear_beta)
    if torch.is_grad_enabled() and x.requires_grad:
        out2d = SituGLUFunction.apply(x2d, beta, linear_beta, backend, workspace_bytes)
    else:
        out2d = _forward(x2d, beta, linear_beta, backend, workspace_bytes)
    return out2d.view(*x.shape[:-1], two_h // 2)
