"""Reference SiTU-GLU: the plain expression, differentiated by autograd (obviously right, memory-hungry).

    x = [gate | up]                       # [..., 2H], split along the last dim
    a = beta * tanh(gate / beta) * sigmoid(gate)
    b = linear_beta * tanh(up / linear_beta)
    out = a * b                           # [..., H]

Every fast path of this package (`streamed_torch.py`, `fused_triton.py`) is tested against it,
and the benchmark uses it as the baseline. No input validation: `situ_glu` is the checked entry.
"""

from __future__ import annotations

import torch


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
