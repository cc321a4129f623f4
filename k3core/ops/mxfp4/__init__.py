"""MXFP4 codec: the release's compressed-tensors `mxfp4-pack-quantized` layout, bit for bit.

Owns: turning a float weight [..., n] into (packed [..., n/2], scale [..., n/32]) uint8 tensors
and back, plus a straight-through fake-quantizer for QAT. Does not own: which tensors are
quantised (the checkpoint code decides that from `quantization_config.ignore`), file I/O.

Public API:
    quantize(w, *, scale_rule, name) -> (packed, scale)      dispatching (Triton on CUDA, else torch)
    dequantize(packed, scale, dtype) -> w
    fake_quantize(w, *, scale_rule) -> w                     QAT round trip, straight-through grad
    quantize_torch / dequantize_torch                        the torch path, any device
    triton_available()                                       whether the Triton kernels import
    BLOCK, E2M1_VALUES, SCALE_RULES                          format constants

Modules: `spec.py` (the format, its scale rules and input checks), `naive.py` (the scalar
reference every path is tested against), `codec_torch.py` (chunked torch path), `codec_triton.py`
(Triton kernels; imported only when used, it needs triton), `api.py` (checked entry points).
Importing this package never imports triton.
"""

from k3core.ops.mxfp4.api import dequantize, fake_quantize, quantize, triton_available
from k3core.ops.mxfp4.codec_torch import dequantize_torch, quantize_torch
from k3core.ops.mxfp4.spec import BLOCK, E2M1_VALUES, SCALE_RULES

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
