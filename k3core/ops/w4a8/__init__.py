"""W4A8 expert matmuls: MXFP4 weights (packed, as the release stores them) times FP8 E4M3 activations.

Owns: FP8 E4M3 activation quantisation (two granularities) and the matmuls an MXFP4 rollout
engine runs for routed experts, ``y = fp8(x) @ mxfp4(W)^T``, for one weight or for a stack of
experts over rows sorted by expert. Does not own: the MXFP4 codec (``k3core.ops.mxfp4``), which
module holds the weights (``k3core.rollout.quantized.W4A8Experts``).

Public API:
    quantize_fp8(x, granularity) -> (q, scale); dequantize_fp8; fake_quantize_fp8     activations
    w4a8_linear(x, packed, wscale, granularity) -> y                              one weight
    w4a8_grouped_mm(x_sorted, counts, packed, wscale, ...) -> y                   expert stack
    w4a8_reference, quantize_fp8_reference, round_to_e4m3_reference, fp8_e4m3_values  references
    triton_available(), FP8_MAX, ACT_GRANULARITIES

Modules: ``fp8.py`` (activation quantisation and its scale rules), ``api.py`` (the matmuls, torch
path and dispatch), ``grouped_mm_triton.py`` (the fused kernel) and ``fp8_triton.py`` (the per-token quantiser
in one kernel), imported only when used (they need triton), ``naive.py`` (the fp64 references every path is tested against). Importing this package
never imports triton.
"""

from k3core.ops.w4a8.api import triton_available, w4a8_grouped_mm, w4a8_linear
from k3core.ops.w4a8.fp8 import ACT_GRANULARITIES, FP8_MAX, dequantize_fp8, fake_quantize_fp8, quantize_fp8
from k3core.ops.w4a8.naive import (
    fp8_e4m3_values,
    quantize_fp8_reference,
    round_to_e4m3_reference,
    w4a8_reference,
)

__all__ = [
    "FP8_MAX",
    "ACT_GRANULARITIES",
    "quantize_fp8",
    "dequantize_fp8",
    "fake_quantize_fp8",
    "w4a8_linear",
    "w4a8_grouped_mm",
    "w4a8_reference",
    "fp8_e4m3_values",
    "round_to_e4m3_reference",
    "quantize_fp8_reference",
    "triton_available",
]
