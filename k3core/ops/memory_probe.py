"""Measure what autograd keeps for backward and the peak memory of one call, to the byte.

Owns: per-call measurements that kernel tests and benchmarks bound (a SiTU-GLU workspace of 64 KiB
within 1 KiB of slack). Does not own: a pipeline stage's peaks, device and host RSS, which
``k3core.device.MemoryProbe`` measures process-wide; RSS moves by pages and keeps what the host
allocator does not return, so it cannot resolve a bound of this size.

* `saved_tensors`: every tensor autograd saves while `fn` runs, through
  `torch.autograd.graph.saved_tensors_hooks`; bytes are counted once per storage (sigmoid's result
  saved by two nodes costs memory once).
* `peak_bytes`: peak of (bytes allocated now - bytes allocated at the start) during `fn`. On CUDA
  from the caching allocator's statistics; on CPU from the allocation/free events that
  `torch.profiler` records with `profile_memory=True` (the CPU allocator reports every one), summed
  in time order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch


@dataclass
class SavedTensors:
    """What autograd saved: one (shape, dtype) per save, and the distinct storages' bytes."""

    saves: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    storages: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def saved_tensors(fn: Callable[[], Any]) -> tuple[Any, SavedTensors]:
    """Run fn() and report the tensors autograd saved for backward during it."""
    report = SavedTensors()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        report.saves.append((tuple(t.shape), t.dtype))
        report.storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, report


def peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """Run fn() and return (result, peak bytes allocated on `device` above the level at the start)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"peak_bytes supports cpu and cuda, got {device}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())  # stable: same-timestamp events keep their order
    level = peak = 0
    for e in events:
        level += e.nbytes()
        peak = max(peak, level)
    return result, peak
