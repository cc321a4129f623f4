"""Flat host allocations, page-locked to (almost) their exact size.

Owns: one contiguous host tensor per arena and its cudaHostRegister lifetime. Does not own what is
carved out of it (callers take views).

Why not `torch.empty(..., pin_memory=True)`: torch's pinned caching allocator rounds every block up
to a power of two (ATen/core/CachingHostAllocator.h), so a 9 GB state buffer would pin 16 GB and the
bytes-per-parameter budget would be fiction. Here the bytes come from the ordinary CPU allocator
and are registered with the CUDA driver as they are, from a page boundary and rounded up to whole
pages (two arenas must never share a page: the driver refuses to register a page twice); they
unregister when the arena is collected. Registered memory is real pinned memory for
cudaMemcpyAsync, so `non_blocking=True` copies are asynchronous DMA.
"""

from __future__ import annotations

import os
import weakref

import torch

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the driver may already be gone
        pass


class HostArena:
    """A host tensor of `numel` elements of `dtype`, pinned when `pin` is set.

    Attributes:
        data: the flat tensor [numel]; carve parameter-shaped state out of it with `view`.
        pinned: whether the bytes are registered with the CUDA driver.
        pinned_nbytes: bytes registered (nbytes rounded up to whole pages), 0 when not pinned.
    """

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool) -> None:
        nbytes = numel * dtype.itemsize
        self.pinned, self.pinned_nbytes = False, 0
        if not (pin and numel > 0):
            self.data = torch.zeros(max(numel, 1), dtype=dtype)[:numel]  # touch pages now, not mid-step
            return
        span = -(-nbytes // PAGE) * PAGE
        raw = torch.zeros(span + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        region = raw[start : start + span]
        self.data = region[:nbytes].view(dtype)
        ptr = region.data_ptr()
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, span, 0))
        self.pinned, self.pinned_nbytes = True, span
        self._finalizer = weakref.finalize(self, _unregister, ptr)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def view(self, offset: int, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """Elements [offset, offset + prod(shape)) as a tensor of `shape` (shares memory)."""
        numel = 1
        for s in shape:
            numel *= s
        return self.data[offset : offset + numel].view(shape)
