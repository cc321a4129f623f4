"""The flash-linear-attention (fla 0.6.0) dispatch: argument translation only, no copies.

fla imports triton at module load, which is absent on CPU-only machines, so the import is lazy and
guarded; ``require`` turns a failed import into an error that says what to install or which
backend to pick instead. Conventions checked against fla 0.6.0's ``fla/ops/kda/chunk.py`` and
``fused_recurrent.py``: same ``[B, T, H, K]`` layout and log-space per-key g as ours, state
``[N, H, K, V]`` fp32 (``state_v_first=False``), ``cu_seqlens`` int64 on the device with ``B == 1``,
L2 norm ``x / sqrt(sum x^2 + 1e-6)`` in kernel, and the in-kernel "safe" gate
``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``use_gate_in_kernel`` and
``lower_bound`` are set (our ``kda_gate``).

Kernel configs: fla autotunes each Triton kernel on its first call for every new shape (minutes for
a KDA forward+backward). fla 0.6 can read the winners from a directory instead (``FLA_CACHE_MODE``,
``FLA_CONFIG_DIR``; ``fla/ops/utils/cache.py``), and k3rl ships them in ``fla_configs/<fla-core
version>/<GPU name>/`` (made by ``fla_tune.py``). Just before fla is imported, ``_load`` points fla
there when a directory exists for the installed fla-core and this GPU; a variable the user set is
left alone. fla reads ``FLA_CACHE_MODE`` once, at import, hence "before".
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

import torch

_MODULE = None
_ERROR: BaseException | None = None

SHIPPED_CONFIGS = Path(__file__).with_name("fla_configs")
# fla's "fuzzy" mode: an exact key first, else the first entry of the same structure (the same
# key arguments and tensor dtypes, so packing, state, dtype and gate variant all match) whatever its
# numbers, else fla autotunes. Tuning every shape k3rl and its tests use costs more device time than
# a session has (docs/results/kda_first_call.md), and "strict" would autotune every untuned shape
# (minutes). A config only decides speed, never the result. fla_tune writes each file's entries
# largest key first, so the fallback is a config that fit the largest head dim tuned (K = V = 128,
# the largest k3rl uses): its tiles fit smaller ones.
SHIPPED_CACHE_MODE = "fuzzy"

INSTALL_HINT = "pip install --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0 (needs triton)"


def gpu_config_name(device: int | None = None) -> str:
    """The CUDA device's name as a directory name (runs of other characters become one ``_``), the
    rule fla uses for its own per-GPU config folders: ``NVIDIA H200`` -> ``NVIDIA_H200``."""
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def shipped_config_dir() -> Path | None:
    """``fla_configs/<fla-core version>/<GPU>/`` when it exists for the installed fla-core and the
    current CUDA device, else None. Configs of another fla version may name kernel arguments that
    no longer exist, and another GPU's may not fit its shared memory: neither is used."""
    if not torch.cuda.is_available():
        return None
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = SHIPPED_CONFIGS / version / gpu_config_name()
    return path if path.is_dir() else None


def point_fla_at_shipped_configs() -> dict[str, str]:
    """Set ``FLA_CACHE_MODE`` and ``FLA_CONFIG_DIR`` for the shipped configs, each only where unset;
    returns what was set. Nothing is set once fla's cache module is imported (it has read the mode
    already) or when no directory fits this GPU and fla version."""
    if "fla.ops.utils.cache" in sys.modules:
        return {}
    path = shipped_config_dir()
    if path is None:
        return {}
    wanted = {"FLA_CACHE_MODE": SHIPPED_CACHE_MODE, "FLA_CONFIG_DIR": str(path)}
    set_now = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


def _load():
    global _MODULE, _ERROR
    if _MODULE is None and _ERROR is None:
        try:
            point_fla_at_shipped_configs()
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
