"""``situ_glu``: the checked entry point of SiTU-GLU, an autograd op that saves only its input.

Owns: validation, the choice of path (fused Triton kernels of `fused_triton.py` on CUDA when
triton imports, else the streamed torch path of `streamed_torch.py`) and the autograd wiring.
Does not own: any of the arithmetic.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from k3core.ops.situ.streamed_torch import (
    CUDA_WORKSPACE_BYTES,
    WORKSPACE_BYTES,
    situ_glu_bwd_torch,
    situ_glu_fwd_torch,
)

__all__ = ["situ_glu", "SituGLUFunction"]

Backend = Literal["auto", "torch", "triton"]


@functools.cache
def _triton_ops():
    """The triton kernels module, or None where triton is not importable (e.g. CPU-only hosts)."""
    try:
        import k3core.ops.situ.fused_triton as fused_triton  # lazy: needs triton
    except ImportError:
        return None
    return fused_triton


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
    return situ_glu_fwd_torch(x2d, beta, linear_beta, workspace_bytes)


def _backward(x2d, grad2d, beta, linear_beta, backend, workspace_bytes):
    if _use_triton(x2d, backend):
        return _triton_ops().situ_glu_bwd(x2d, grad2d, beta, linear_beta)
    return situ_glu_bwd_torch(x2d, grad2d, beta, linear_beta, workspace_bytes)


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
