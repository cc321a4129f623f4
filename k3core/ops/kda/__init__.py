"""Kimi Delta Attention (KDA) operator.

Public API:
    kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens,
        backend, A_log, dt_bias, lower_bound) -> (o, final_state)   training / prefill
    kda_step(q, k, v, g, beta, state, scale, use_qk_l2norm) -> (o, new_state)        decode
    kda_gate(f, A_log, dt_bias, lower_bound) -> g                                    safe gate
    naive_kda(...)                                       per-token reference (tests, checks)

Layout: ``[B, T, H, K]`` activations, ``[N, H, K, V]`` fp32 state. On CUDA ``kda`` dispatches to
flash-linear-attention (``fla.ops.kda``); the torch chunked path runs everywhere. Importing this
package never imports fla or triton.
"""

from k3core.ops.kda.api import kda
from k3core.ops.kda.gate import kda_gate
from k3core.ops.kda.naive import naive_kda
from k3core.ops.kda.recurrent import kda_step

__all__ = ["kda", "kda_step", "kda_gate", "naive_kda"]
