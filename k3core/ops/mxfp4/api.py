"""The checked entry points of the MXFP4 codec: `quantize`, `dequantize`, `fake_quantize`.

Owns: validation at the edge and the choice of path (the Triton kernels of `codec_triton.py` on
CUDA when triton imports, else the chunked torch path of `codec_torch.py`). Does not own: the
format (`spec.py`) or any element arithmetic. Every path gives the same bytes.
"""

from __future__ import annotations

import torch

from k3core.ops.mxfp4.codec_torch import dequantize_torch, quantize_torch
from k3core.ops.mxfp4.spec import check_dequantize_input, check_quantize_input, check_scale_rule

__all__ = ["quantize", "dequantize", "fake_quantize", "triton_available"]


def triton_available() -> bool:
    """True when the Triton kernels can be imported (CUDA torch with triton installed)."""
    try:
        import k3core.ops.mxfp4.codec_triton  # noqa: F401  (lazy: needs triton)
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
    check_scale_rule(scale_rule)
    check_quantize_input(w)
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
    check_dequantize_input(packed, scale, dtype)
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
