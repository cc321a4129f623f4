"""Plain references for the transfer's fast paths, for tests: slow, obviously right, sharing no code.

``sum64_reference(data)``: the ``sum64`` digest (``digest.py``) in Python integers, one 8-byte word
at a time, straight from its definition: bytes zero-padded to a multiple of 8, little-endian words
``w_0..w_{n-1}``, ``S1 = sum_i w_i * (2i + 1)`` and ``S2 = sum_i w_i`` mod 2^64, printed as 32 hex
digits. The fast path (``digest.tensor_digest(t, "sum64")``) computes the same with torch ops on the
tensor's own device, in chunks, relying on int64 wrap-around.
"""

from __future__ import annotations

__all__ = ["sum64_reference"]

_MASK = (1 << 64) - 1


def sum64_reference(data: bytes) -> str:
    """The ``sum64`` definition in plain Python integers (slow; the oracle for ``tensor_digest``)."""
    data = bytes(data) + b"\0" * (-len(data) % 8)
    s1 = s2 = 0
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i: 8 * i + 8], "little")
        s1 = (s1 + w * (2 * i + 1)) & _MASK
        s2 = (s2 + w) & _MASK
    return f"{s1:016x}{s2:016x}"
