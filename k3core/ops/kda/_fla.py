"""The flash-linear-attention (fla 0.6.0) dispatch: argument translation only, no copies.

fla imports triton at module load, which is absent on CPU-only machines, so the import is lazy and
guarded; ``require`` turns a failed import into an error that says what to install or which
backend to pick instead. Conventions checked against fla 0.6.0's ``fla/ops/kda/chunk.py`` and
``fused_recurrent.py``: same ``[B, T, H, K]`` layout and log-space per-key g as ours, state
``[N, H, K, V]`` fp32 (``state_v_first=False``), ``cu_seqlens`` int64 on the device with ``B == 1``,
L2 norm ``x / sqrt(sum x^2 + 1e-6)`` in kernel, and the in-kernel "safe" gate
``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``use_gate_in_kernel`` and
``lower_bound`` are set (our ``kda_gate``).
"""

from __future__ import annotations

import torch

_MODULE = None
_ERROR: BaseException | None = None

INSTALL_HINT = "pip install --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0 (needs triton)"


def _load():
    global _MODULE, _ERROR
    if _MODULE is None and _ERROR is None:
        try:
            import fla.ops.kda as module  # noqa: PLC0415  (lazy: imports triton)
            _MODULE = module
        except Exception as e:  # ImportError without triton; other errors from a broken install
            _ERROR = e
    return _MODULE


def available() -> bool:
    """True when ``fla.ops.kda`` imports (triton present)."""
    return _load() is not None


def require(fn: str):
    module = _load()
    if module is None:
        raise RuntimeError(
            f"{fn}: CUDA tensors are dispatched to flash-linear-attention, which failed to import "
            f"({type(_ERROR).__name__}: {_ERROR}). Install it ({INSTALL_HINT}) or pass "
            f"backend='torch' for the (slower) chunked torch path.")
    return module


def _safe_gate(lower_bound) -> bool:
    # fla's M=16 TensorCore path is valid for gates bounded in [lower_bound, 0), lower_bound >= -5
    return lower_bound is not None and -5.0 <= float(lower_bound) < 0.0


def _gate_kwargs(A_log, dt_bias, lower_bound) -> dict:
    if A_log is None:
        return {}
    return dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=float(lower_bound))


def _varlen_kwargs(cu_seqlens, device) -> dict:
    if cu_seqlens is None:
        return {}
    kw = {"cu_seqlens": cu_seqlens.to(device=device, dtype=torch.long)}
    if cu_seqlens.device.type == "cpu":  # lets fla skip a device -> host copy
        kw["cu_seqlens_cpu"] = cu_seqlens.to(torch.long)
    return kw


def _state(initial_state):
    return None if initial_state is None else initial_state.float()  # no-op for fp32 (fla asserts fp32)


def chunk(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
          cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None):
    """``fla.ops.kda.chunk_kda`` with our argument names. With ``A_log``/``dt_bias``, g is the raw
    gate input f; with only ``lower_bound``, g is already gated and promised >= lower_bound."""
    module = require("kda")
    return module.chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=_state(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm, safe_gate=_safe_gate(lower_bound),
        **_gate_kwargs(A_log, dt_bias, lower_bound), **_varlen_kwargs(cu_seqlens, q.device))


def fused_recurrent(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
                    cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None):
    """``fla.ops.kda.fused_recurrent_kda`` (forward only: decode). Shapes as ``chunk``."""
    module = require("kda_step")
    return module.fused_recurrent_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=_state(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm, **_gate_kwargs(A_log, dt_bias, lower_bound),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long))
