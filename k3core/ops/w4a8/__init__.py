"""W4A8 package: `api.py` (activation quantisation, the matmuls and their references),
`grouped_mm_triton.py` (the fused kernel, imported only when used)."""

from k3core.ops.w4a8.api import (
    ACT_GRANULARITIES,
    FP8_MAX,
    dequantize_fp8,
    fake_quantize_fp8,
    fp8_e4m3_values,
    quantize_fp8,
    quantize_fp8_reference,
    round_to_e4m3_reference,
    triton_available,
    w4a8_grouped_mm,
    w4a8_linear,
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
