"""W4A8 expert matmuls, ``y = fp8(x) @ mxfp4(W)^T``: the checked entry points and the torch path.

Owns: ``w4a8_linear`` (one weight) and ``w4a8_grouped_mm`` (a stack of experts over rows sorted
by expert), and the choice between the torch path and the fused Triton kernel of
``grouped_mm_triton.py``. Does not own: activation quantisation (``fp8.py``), the MXFP4 codec
(``k3core.ops.mxfp4``).

Matmuls. Every decoded MXFP4 weight (E2M1 value * 2^(b-127)) and every decoded FP8 activation
(times a power-of-two scale) is exact in fp32 and bf16, so the only roundings are the FP8
rounding of x and the accumulation. The torch path (CPU, and CUDA without triton) decodes the
weights of the experts in use to fp32 per call (no decoded copy is kept) and multiplies in fp32.
On CUDA with triton, ``grouped_mm_triton.w4a8_grouped_mm_triton`` decodes MXFP4 inside the
matmul's K loop (bf16 tensor cores, fp32 accumulation), after per-token activations are quantised
by one kernel (``fp8_triton``). ``naive.w4a8_reference`` is the plain
fp64 version.
"""

from __future__ import annotations

import torch

from k3core.ops.mxfp4 import BLOCK, dequantize
from k3core.ops.w4a8.fp8 import check_granularity, dequantize_fp8, quantize_fp8

__all__ = ["w4a8_linear", "w4a8_grouped_mm", "triton_available"]


def _check_weights(packed: torch.Tensor, wscale: torch.Tensor, k: int, stacked: bool) -> None:
    nd = 3 if stacked else 2
    if packed.dtype != torch.uint8 or wscale.dtype != torch.uint8:
        raise ValueError(f"w4a8: packed weights and scales must be uint8, got {packed.dtype} and {wscale.dtype}")
    if packed.ndim != nd or wscale.ndim != nd:
        raise ValueError(f"w4a8: expected {nd}-d packed/scale tensors, got {tuple(packed.shape)} and {tuple(wscale.shape)}")
    if packed.shape[-1] * 2 != k or wscale.shape[-1] * BLOCK != k or packed.shape[:-1] != wscale.shape[:-1]:
        raise ValueError(f"w4a8: activations have K={k}, weights packed {tuple(packed.shape)} scale "
                         f"{tuple(wscale.shape)} (expected [..., M, K/2] and [..., M, K/32])")


def _activations_fp32(x: torch.Tensor, granularity: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(activations as the matmul sees them, in fp32; per-row scale to apply after, or None)."""
    if granularity is None:  # weight-only MXFP4 (W4A16): activations as they are
        return x.float(), None
    q, s = quantize_fp8(x, granularity)
    if granularity == "token":
        return q.float(), s
    return dequantize_fp8(q, s, torch.float32), None


def w4a8_linear(x: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor,
                granularity: str | None = "token") -> torch.Tensor:
    """x ``[..., K]`` times one MXFP4 weight (packed ``[M, K/2]``, scale ``[M, K/32]``) -> ``[..., M]``
    in x's dtype: ``fp8(x) @ W^T`` (``granularity=None``: x unquantised, weight-only MXFP4)."""
    if granularity is not None:
        check_granularity(granularity)
    _check_weights(packed, wscale, x.shape[-1], stacked=False)
    a, s = _activations_fp32(x, granularity)
    y = a @ dequantize(packed, wscale, torch.float32).t()
    return (y if s is None else y * s).to(x.dtype)


def triton_available() -> bool:
    """True when the fused Triton kernel can be imported (CUDA torch with triton installed)."""
    try:
        import k3core.ops.w4a8.grouped_mm_triton  # noqa: F401  (lazy: needs triton)
    except ImportError:
        return False
    return True


def w4a8_grouped_mm(x_sorted: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor,
                    granularity: str | None = "token", out_dtype: torch.dtype | None = None,
                    use_triton: bool | None = None) -> torch.Tensor:
    """Rows sorted by expert times that expert's MXFP4 weight.

    x_sorted ``[n, K]``; counts ``[E]`` (rows per expert, summing to n); packed uint8 ``[E, M, K/2]``;
    wscale uint8 ``[E, M, K/32]`` -> ``[n, M]`` in ``out_dtype`` (default x's dtype), row i of expert
    e being ``fp8(x_i) @ W_e^T``. On CUDA with triton the fused kernel runs (``use_triton`` forces a
    choice); otherwise each expert in use is decoded to fp32 (one expert at a time) and multiplied."""
    if granularity is not None:
        check_granularity(granularity)
    _check_weights(packed, wscale, x_sorted.shape[-1], stacked=True)
    E, M = packed.shape[0], packed.shape[1]
    if counts.shape != (E,):
        raise ValueError(f"w4a8: counts has shape {tuple(counts.shape)}, expected ({E},)")
    out_dtype = out_dtype or x_sorted.dtype
    if use_triton is None:
        use_triton = x_sorted.is_cuda and granularity is not None and triton_available()
    if use_triton:
        from k3core.ops.w4a8.fp8_triton import quantize_fp8_token_triton
        from k3core.ops.w4a8.grouped_mm_triton import w4a8_grouped_mm_triton

        # per token: one quantising kernel (the same bytes as quantize_fp8) instead of about eleven
        q, s = quantize_fp8_token_triton(x_sorted) if granularity == "token" else quantize_fp8(x_sorted, granularity)
        return w4a8_grouped_mm_triton(q, s, counts, packed, wscale, out_dtype)
    a, s = _activations_fp32(x_sorted, granularity)
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            outs.append(a[start:start + n] @ dequantize(packed[e], wscale[e], torch.float32).t())
            start += n
    out = torch.cat(outs) if outs else a.new_zeros(0, M)
    if s is not None:
        out = out * s
    return out.to(out_dtype)
