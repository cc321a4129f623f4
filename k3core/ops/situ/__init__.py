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

Public API:
    situ_glu(x, beta, linear_beta, *, backend, workspace_bytes) -> out    the checked op
    situ_glu_reference(x, beta, linear_beta) -> out                       plain autograd reference
    SituGLUFunction, rows_per_chunk, WORKSPACE_BYTES, CUDA_WORKSPACE_BYTES, FWD_BUFFERS, BWD_BUFFERS

Paths, all behind one `torch.autograd.Function` (`api.py`):
  * CUDA with triton importable, fp16/bf16/fp32 input: one fused forward kernel and one fused
    backward kernel that writes d_gate and d_up (`fused_triton.py`); no fp32 temporaries at all.
  * otherwise (CPU, or CUDA without triton): torch ops streamed over row chunks through one
    fixed-size fp32 workspace, so no full-size fp32 temporary ever exists (`streamed_torch.py`).
The reference every path is tested against is `naive.py`.

This package owns the math and the memory contract; it knows nothing about experts or routing.
The gradient is not written into the saved input's storage: the op cannot prove that nobody else
holds that storage (the caller, another node of the graph, or a second backward under
`retain_graph=True`), so `d_x` is a fresh tensor in the input dtype. Importing this package never
imports triton.
"""

from k3core.ops.situ.api import SituGLUFunction, situ_glu
from k3core.ops.situ.naive import situ_glu_reference
from k3core.ops.situ.streamed_torch import (
    BWD_BUFFERS,
    CUDA_WORKSPACE_BYTES,
    FWD_BUFFERS,
    WORKSPACE_BYTES,
    rows_per_chunk,
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
