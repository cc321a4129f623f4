"""Reference KDA: the per-token recurrence, written to be obviously right (and slow).

Per head, with q, k L2-normalised when ``use_qk_l2norm``:
    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * q_t^T S_t
Every fast path in this package (``chunk.py``, ``recurrent.py``, the fla dispatch) is tested
against this function. It does no input validation: use ``kda(..., backend="naive")`` for the
checked entry point.
"""

from __future__ import annotations

import torch

from k3core.ops.kda._common import compute_dtype, l2norm


def naive_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``.
        g: ``[B, T, H, K]`` log-space per-key decay (<= 0). beta: ``[B, T, H]`` in (0, 1).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        cu_seqlens: ``[N + 1]`` sequence boundaries in a packed ``B == 1`` batch; each sequence
            starts from its own initial state.

    Returns:
        (o ``[B, T, H, V]`` in q's dtype, final state ``[N, H, K, V]`` in the compute dtype or None).
        Computation is fp32 (fp64 for fp64 inputs).
    """
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        outs, states = [], []
        for n in range(len(bounds) - 1):
            s, e = bounds[n], bounds[n + 1]
            h0 = None if initial_state is None else initial_state[n : n + 1]
            o_n, s_n = _naive_dense(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                    scale, h0, use_qk_l2norm)
            outs.append(o_n)
            states.append(s_n)
        o = torch.cat(outs, dim=1)
        return o, (torch.cat(states, dim=0) if output_final_state else None)
    o, s = _naive_dense(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    return o, (s if output_final_state else None)


def _naive_dense(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        k_t, v_t, b_t = k[:, t], v[:, t], beta[:, t, :, None]        # [B,H,K], [B,H,V], [B,H,1]
        S = g[:, t].exp()[..., None] * S                              # Diag(exp(g_t)) S_{t-1}
        kS = torch.einsum("bhk,bhkv->bhv", k_t, S)                    # k_t^T D S
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t * (v_t - kS))  # (I - b k k^T) D S + b k v^T
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else q.new_zeros(B, 0, H, V)
    return o.to(out_dtype), S
