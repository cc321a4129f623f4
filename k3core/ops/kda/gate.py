"""KDA "safe gate": raw gate logits f -> log-space per-key decay g in [lower_bound, 0).

    g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))

This is the formula of fla's ``naive_kda_lowerbound_gate`` and of ``chunk_kda(use_gate_in_kernel=
True, lower_bound=...)``; ``kda(..., A_log=, dt_bias=, lower_bound=)`` hands the raw f to fla's
fused gate on CUDA and calls this function first everywhere else.
"""

from __future__ import annotations

import torch

from k3core.ops.compiled import compiled, use_compiled


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """f ``[B, T, H, K]``, A_log ``[H]``, dt_bias ``[H * K]`` -> g ``[B, T, H, K]``.

    Computed and returned in fp32 (fp64 when f is fp64), whatever f's dtype: the decay feeds a
    long product, so it is kept out of bf16.
    """
    if f.dim() != 4:
        raise ValueError(f"kda_gate: argument `f` has shape {tuple(f.shape)}; expected [B, T, H, K]")
    H, K = f.shape[-2:]
    if tuple(A_log.shape) != (H,):
        raise ValueError(f"kda_gate: argument `A_log` has shape {tuple(A_log.shape)}; expected [H] = ({H},)")
    if tuple(dt_bias.shape) != (H * K,):
        raise ValueError(
            f"kda_gate: argument `dt_bias` has shape {tuple(dt_bias.shape)}; expected [H * K] = ({H * K},)")
    if not lower_bound < 0:
        raise ValueError(f"kda_gate: `lower_bound` must be < 0, got {lower_bound}")
    if use_compiled(f):  # the trainer on CUDA: one fused kernel each way (k3core.ops.compiled)
        return compiled(kda_gate_reference)(f, A_log, dt_bias, lower_bound)
    return kda_gate_reference(f, A_log, dt_bias, lower_bound)


def kda_gate_reference(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """The gate in plain torch ops (shapes checked by ``kda_gate``)."""
    H, K = f.shape[-2:]
    dt = torch.float64 if f.dtype == torch.float64 else torch.float32
    x = f.to(dt) + dt_bias.to(dt).view(H, K)
    return lower_bound * torch.sigmoid(A_log.to(dt).exp()[:, None] * x)
