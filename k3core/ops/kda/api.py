"""``kda``: the checked entry point of the KDA operator, dispatching to fla (CUDA) or torch.

It owns validation and backend choice; the math lives in ``naive.py`` (reference), ``chunk.py``
(torch) and fla's kernels. It holds no state: the caller carries ``final_state`` between calls.
"""

from __future__ import annotations

import torch

from k3core.ops.kda._checks import check_kda_inputs, resolve_backend
from k3core.ops.kda._fla import chunk as fla_chunk
from k3core.ops.kda._fla import fused_recurrent as fla_fused_recurrent
from k3core.ops.kda.chunk import chunk_kda_torch
from k3core.ops.kda.gate import kda_gate
from k3core.ops.kda.naive import naive_kda


def kda(
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
    cu_seqlens_cpu: torch.Tensor | None = None,
    backend: str = "auto",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention over whole sequences (training / prefill).

    Per head, with q, k L2-normalised (``x / sqrt(sum x^2 + 1e-6)``) when ``use_qk_l2norm``:
        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale q_t^T S_t

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (q, k, v share one dtype).
        g: ``[B, T, H, K]`` log-space per-key decay, <= 0 (already gated, e.g. by ``kda_gate``);
            in raw-gate mode (``A_log`` and ``dt_bias`` given) the gate input f instead.
        beta: ``[B, T, H]`` in (0, 1).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: return the state after the last token of each sequence.
        cu_seqlens: int ``[N + 1]``, sequences packed along T with B == 1 (as in fla); each
            sequence starts from its own initial state (zeros when ``initial_state`` is None).
        cu_seqlens_cpu: the same offsets on the host, when ``cu_seqlens`` lives on the device (as
            fla takes them): the checks and the kernels read the offsets there, with no host sync;
            the caller copies ``cu_seqlens`` to the device once for all its calls.
        backend: "auto" (fla for CUDA tensors, torch chunked otherwise), "torch" (chunked, any
            device), "naive" (token loop reference), "fla" (CUDA only). A CUDA tensor with "auto"
            and no importable fla raises (pass backend="torch" to opt into the slow path).
        A_log ``[H]``, dt_bias ``[H * K]``, lower_bound: raw-gate mode: g holds f and the decay is
            ``kda_gate(f, A_log, dt_bias, lower_bound)``, fused into fla's kernel on CUDA and computed
            by ``kda_gate`` first elsewhere. ``lower_bound`` alone (g already gated) promises
            g >= lower_bound, which lets fla use its faster safe-gate path when lower_bound >= -5.

    Returns:
        o ``[B, T, H, V]`` in q's dtype; final_state ``[N, H, K, V]`` (fp32; fp64 for fp64 inputs
        on the torch paths) or None. Computation is fp32 (fp64 for fp64 inputs).
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, cu_seqlens_cpu)
    backend = resolve_backend("kda", backend, q, allow_naive=True)
    common = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)
    if backend == "fla":
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
        # one-token decode: the fused recurrent kernel (forward only) beats the chunked one
        if q.shape[1] == 1 and not needs_grad:
            return fla_fused_recurrent(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                       **common)
        return fla_chunk(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                         cu_seqlens_cpu=cu_seqlens_cpu, **common)
    if cu_seqlens_cpu is not None:  # the torch paths read the offsets on the host
        common["cu_seqlens"] = cu_seqlens = cu_seqlens_cpu
    if A_log is not None:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if backend == "naive":
        return naive_kda(q, k, v, g, beta, **common)
    # short sequences (RL prompts, decode chunks) waste most of a 64-token chunk: use the smallest
    # power of two >= T (at least 16); the result is the same, the work ~4x less at T ~ 10
    T = q.shape[1] if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    chunk = min(64, max(16, 1 << max(T - 1, 1).bit_length()))
    return chunk_kda_torch(q, k, v, g, beta, chunk_size=chunk, **common)
