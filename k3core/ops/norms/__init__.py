"""Fused inference kernels for the per-token normalisations: RMSNorm and the AttnRes mix.

Contract: the torch functions they replace, which stay the references (and the only path under
autograd, on the CPU, and without triton):
    rms_norm(x, weight, eps)             ``k3core.model.norm.rms_norm``: ``weight * x / sqrt(mean(x^2) + eps)``
    attn_res_mix(p, blocks, w_gamma, eps) ``k3core.model.attnres.attn_res_mix``: softmax over the candidates
                                          of their RMS-normalised scores, then their weighted sum
Both compute in fp32 and return the input dtype. Inside ``fused_inference()`` (the forwards of an
engine model, ``K3ForCausalLM`` with inference caches on: the rollout engine's prefill and decode
steps, CUDA graphs included, and the mismatch metric's engine path), on CUDA with triton and with no
gradient to record, each call is one Triton kernel (``fused_triton.py``) where the torch path runs nine (RMSNorm: upcast,
square, mean, add, rsqrt, two products, weight upcast, downcast) and thirteen (AttnRes: stack, upcast,
norm, scores, softmax, products, sum, downcast). A decode step of the medium preset calls them
about 150 times. The results equal the torch path's up to the order of the fp32 sums (and
the softmax's online form): not bit for bit. That is why only engine forwards take them: the
trainer's forwards (old log-probabilities, the update, the reference) stay on one path, so the
first update's ratio is exactly 1.

``FUSED`` (default True) turns the fused path off, for comparisons. Importing this package never
imports triton.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["FUSED", "fused_available", "fused_inference", "in_engine", "use_fused"]

FUSED = True
_IN_ENGINE = contextvars.ContextVar("k3core_fused_inference", default=False)
_AVAILABLE: bool | None = None
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fused_available() -> bool:
    """True when the Triton kernels import (triton installed)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            import k3core.ops.norms.fused_triton  # noqa: F401  (lazy: needs triton)

            _AVAILABLE = True
        except ImportError:
            _AVAILABLE = False
    return _AVAILABLE


@contextlib.contextmanager
def fused_inference(on: bool = True):
    """Calls inside (in this thread or task) may take the fused kernels."""
    token = _IN_ENGINE.set(on)
    try:
        yield
    finally:
        _IN_ENGINE.reset(token)


def in_engine() -> bool:
    """Whether this call runs inside an engine forward (``fused_inference``)."""
    return _IN_ENGINE.get()


def use_fused(*tensors: torch.Tensor | None) -> bool:
    """Whether a call over ``tensors`` takes the fused path: inside ``fused_inference``, CUDA, a
    float dtype the kernels take, no gradient to record, triton importable, ``FUSED`` on."""
    ts = [t for t in tensors if t is not None]
    if not FUSED or not _IN_ENGINE.get() or not ts or not all(t.is_cuda and t.dtype in _DTYPES for t in ts):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return fused_available()
