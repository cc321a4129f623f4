"""torch.compile'd forms of the trainer's elementwise regions on CUDA: the AttnRes mix, RMSNorm and
the KDA gate.

Why: eager, each region is a chain of small kernels (the AttnRes mix alone: stack, upcast, square,
mean, rsqrt, products, sum, softmax, weighted sum, downcast, and their backward), and autograd keeps
the fp32 intermediates of each for the backward. Inductor fuses each region into a few kernels
forward and backward and saves less for the backward, so the step launches fewer kernels and peaks
lower (figures: docs/results/train_mfu.md).

Contract: ``use_compiled(x)`` says whether a call takes its region's compiled form: ``COMPILED`` on,
a CUDA tensor, and not inside an engine forward (``k3core.ops.norms.fused_inference``: the engine
has its own fused Triton kernels, and its CUDA graphs must never meet a recompile). Every trainer
forward on CUDA takes it, with or without a gradient, so the old log-probabilities, the update and
the reference stay on one path and the first update's ratio stays exactly 1. ``compiled(fn)`` is
``torch.compile(fn, dynamic=True)``, built once per function; ``fn`` (the eager torch code) is the
reference the tests hold the compiled form to. The results equal the eager ones up to the order of
fp32 sums and where a bf16 rounding between two ops disappears.

``COMPILED = False`` turns it off (comparisons; a machine without a working inductor toolchain).
Importing this module never imports inductor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3core.ops.norms import in_engine

COMPILED = True
# the devices whose tensors take the compiled forms; tests add "cpu" to hold them to the eager code
DEVICES = {"cuda"}
_CACHE: dict[Callable, Callable] = {}


def use_compiled(x: torch.Tensor) -> bool:
    return (COMPILED and x.device.type in DEVICES and not in_engine()
            and not torch.compiler.is_compiling())


def compiled(fn: Callable) -> Callable:
    c = _CACHE.get(fn)
    if c is None:
        c = _CACHE[fn] = torch.compile(fn, dynamic=True)
    return c
