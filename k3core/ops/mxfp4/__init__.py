"""MXFP4 codec package: `naive.py` (the scalar reference), `codec_torch.py` (the torch codec and
the dispatch), `codec_triton.py` (the Triton kernels, imported only when used)."""

from k3core.ops.mxfp4.codec_torch import (
    BLOCK,
    E2M1_VALUES,
    SCALE_RULES,
    dequantize,
    dequantize_torch,
    fake_quantize,
    quantize,
    quantize_torch,
    triton_available,
)

__all__ = [
    "BLOCK",
    "E2M1_VALUES",
    "SCALE_RULES",
    "quantize",
    "dequantize",
    "fake_quantize",
    "quantize_torch",
    "dequantize_torch",
    "triton_available",
]
