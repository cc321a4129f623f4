"""SiTU-GLU package: `streamed_torch.py` (the op, its reference and the streamed torch path),
`fused_triton.py` (the Triton kernels, imported only when used)."""

from k3core.ops.situ.streamed_torch import (
    BWD_BUFFERS,
    CUDA_WORKSPACE_BYTES,
    FWD_BUFFERS,
    WORKSPACE_BYTES,
    SituGLUFunction,
    rows_per_chunk,
    situ_glu,
    situ_glu_reference,
)

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
