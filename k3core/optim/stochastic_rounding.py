"""Stochastic rounding fp32 -> bf16, used to store Adam moments in 2 bytes each.

Why stochastic rounding (and not error compensation): with beta2 = 0.999 the second-moment update
`v += (1 - beta2) * (g^2 - v)` changes v by ~0.1% per step, less than half a bf16 ulp (2^-9 = 0.2%),
so round-to-nearest leaves v frozen. Error compensation (Kahan) fixes that but stores an extra
correction term per moment, which would undo the 8-bytes-per-parameter budget. Stochastic rounding
costs no storage: it rounds up with probability equal to the discarded fraction, so the stored
value is unbiased, E[round(x)] = x, and small updates survive on average.

Bit recipe: for an fp32 `x` with bit pattern `b` (int32) and uniform noise `r` in [0, 2^16),
`bf16_bits = (b + r) >> 16`. Adding to the sign-magnitude pattern increases the magnitude, so the
carry into bit 16 happens with probability (low 16 bits of b) / 2^16, for either sign; a carry
into the exponent is the correct round-up into the next binade.

Noise: a fixed table of 2^20 uniform 16-bit draws (int32, 4 MiB) made from a seed; the noise of
element `i` under key `k` (parameter, step, moment) is `table[(offset(k) + i) mod 2^20]`. A
parameter's noise at a step is therefore a contiguous (wrapping) slice of the table: no random
numbers are generated in the hot loop, and the noise depends only on (seed, key, element index),
not on how the update is cut into chunks, so a chunked update equals an unchunked one bit for bit
and a resumed run equals an uninterrupted one. Elements 2^20 apart share a draw within one step;
each element's own sequence of draws over steps is independent (fresh random offset every step),
which is what unbiasedness over time needs.

The plain reference the tests hold this to (``noise_for``, ``stochastic_round_to_bf16_reference``):
``k3core.optim.naive``.
"""

from __future__ import annotations

import torch

NOISE_TABLE_NUMEL = 1 << 20
_MASK64 = (1 << 64) - 1


def make_noise_table(seed: int) -> torch.Tensor:
    """Uniform integers in [0, 2^16) as int32, shape [NOISE_TABLE_NUMEL], reproducible from seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 16, (NOISE_TABLE_NUMEL,), dtype=torch.int32, generator=gen)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_offset(seed: int, *key: int) -> int:
    """Start of the noise slice for `key` (e.g. parameter index, step, moment id), in [0, T)."""
    h = _splitmix64(seed & _MASK64)
    for k in key:
        h = _splitmix64(h ^ (k & _MASK64))
    return h % NOISE_TABLE_NUMEL


def add_noise_(bits: torch.Tensor, table: torch.Tensor, offset: int, start: int) -> None:
    """bits[j] += table[(offset + start + j) mod T] in place; bits is int32 [n].

    `start` is the index of bits[0] inside its parameter, so a parameter cut into any chunks gets
    the same noise per element. Wraps around the table in contiguous pieces.
    """
    n = bits.numel()
    pos = (offset + start) % NOISE_TABLE_NUMEL
    done = 0
    while done < n:
        take = min(n - done, NOISE_TABLE_NUMEL - pos)
        bits[done : done + take].add_(table[pos : pos + take])
        done += take
        pos = 0


def stochastic_round_to_bf16_(
    src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, offset: int, start: int
) -> None:
    """dst = SR(src) with the table's noise; src fp32 [n] is clobbered (used as scratch), dst bf16 [n].

    Fast path: two in-place integer passes on src plus one narrowing copy. The shifted value of an
    int32 lies in [-2^15, 2^15), so the int32 -> int16 copy is exact and is the bf16 bit pattern.
    Non-finite inputs are not supported (moments are finite in a finite run).
    """
    bits = src.view(torch.int32)
    add_noise_(bits, table, offset, start)
    bits.bitwise_right_shift_(16)
    dst.view(torch.int16).copy_(bits)
