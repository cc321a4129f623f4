"""SiTU-GLU MLP (K3's dense MLP and shared experts).

``down_proj(situ_glu(gate_up_proj(x)))`` where ``gate_up_proj`` fuses the public ``gate_proj`` and
``up_proj`` (rows ``[gate; up]``, so the public tensors are its two halves) and ``situ_glu`` is the
streaming SiTU-GLU operator (``k3core.ops.situ``): ``a = beta*tanh(gate/beta)*sigmoid(gate)``,
``b = linear_beta*tanh(up/linear_beta)``, output ``a*b``.
"""

from __future__ import annotations

import torch
from torch import nn

from k3core.ops.situ import situ_glu


class SiTUMLP(nn.Module):
    """x ``[..., hidden]`` -> ``[..., hidden]``; ``gate_up_proj.weight`` ``[2I, hidden]``,
    ``down_proj.weight`` ``[hidden, I]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, beta: float = 4.0, linear_beta: float = 25.0):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_up_proj(x), self.beta, self.linear_beta))
