"""KDA decode step: advance a carried state by one (or a few) tokens.

Same recurrence as ``naive.py``; this is the path a decoder calls once per generated token.
It owns no cache: the caller keeps ``state`` ``[B, H, K, V]`` (fp32) between calls.
"""

from __future__ import annotations

import torch

from k3core.ops.kda._checks import check_step_inputs, resolve_backend
from k3core.ops.kda._common import compute_dtype, l2norm
from k3core.ops.kda._fla import fused_recurrent as fla_fused_recurrent
from k3core.ops.kda._fla import fused_recurrent_inplace as fla_fused_recurrent_inplace


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    *,
    backend: str = "auto",
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (or a few tokens) of KDA with a carried state.

    Shapes: either a single token, q, k, g ``[B, H, K]``, v ``[B, H, V]``, beta ``[B, H]``
    -> o ``[B, H, V]``; or a few tokens, q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]`` -> o ``[B, T, H, V]`` (a token loop: meant for small T, use ``kda`` for
    prefill). ``state`` ``[B, H, K, V]`` (None = zeros); ``new_state`` has the same shape, fp32
    (fp64 for fp64 inputs). o is in q's dtype. g is the already-gated log decay (``kda_gate``).

    backend: "auto" (fla's ``fused_recurrent_kda`` for CUDA tensors when no gradient is needed,
    else torch), "torch", or "fla". The input ``state`` is never modified in place, unless
    ``inplace``: then ``state`` (given, no gradient) is advanced in place and returned as
    ``new_state``. On fla with an fp32 contiguous state, the kernel writes the new state over the
    one it read (each program owns its block of the state), so a decode step reads and writes the
    state once and allocates nothing, where a copy back would move it twice more; otherwise the new
    state is computed and copied into ``state``.
    """
    if inplace and state is None:
        raise ValueError("kda_step: inplace=True needs a state to advance")
    single = isinstance(q, torch.Tensor) and q.dim() == 3
    check_step_inputs(q, k, v, g, beta, state, single)
    if single:
        q, k, v, g, beta = (x.unsqueeze(1) for x in (q, k, v, g, beta))
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, state))
    backend = resolve_backend("kda_step", backend, q, allow_naive=False, prefer_torch=needs_grad)
    if backend == "fla" and inplace and state.dtype == torch.float32 and state.is_contiguous() and not needs_grad:
        o = fla_fused_recurrent_inplace(q, k, v, g, beta, scale=scale, state=state, use_qk_l2norm=use_qk_l2norm)
        return (o.squeeze(1) if single else o), state
    if backend == "fla":
        o, new_state = fla_fused_recurrent(q, k, v, g, beta, scale=scale, initial_state=state,
                                           output_final_state=True, use_qk_l2norm=use_qk_l2norm)
    else:
        o, new_state = _torch_step(q, k, v, g, beta, state, scale, use_qk_l2norm)
    if inplace:
        state.copy_(new_state)
        new_state = state
    return (o.squeeze(1) if single else o), new_state


def _torch_step(q, k, v, g, beta, state, scale, use_qk_l2norm):
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    scale = K**-0.5 if scale is None else scale
    q, k = (l2norm(q, scale=scale), l2norm(k)) if use_qk_l2norm else (q * scale, k)
    S = q.new_zeros(B, H, K, V) if state is None else state.to(dt)
    outs = []
    for t in range(T):
        S = g[:, t].exp()[..., None] * S
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * err)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, dim=1).to(out_dtype), S
