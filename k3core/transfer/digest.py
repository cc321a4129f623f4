"""Content digests of tensors for weight transfer: which algorithm, and the bytes it covers.

Owns: ``tensor_digest(t, algo)`` (a hex string over ``t``'s bytes in memory order, little-endian,
as ``t.contiguous().view(uint8)`` lays them out), the algorithm names a manifest may carry and the
default choice. Does not own: what a digest is compared against (the transports do that), nor the
slow, obviously-right ``sum64`` the device-side checksum is tested against (``naive.py``).

Algorithms:
- ``"xxh3_128"``: xxHash3, 128 bit (the ``xxhash`` package). Not cryptographic; on one core it
  hashes about as fast as memory copies, so checking does not halve a transfer. The default on CPU
  when ``xxhash`` is importable.
- ``"sha256"``: hashlib (OpenSSL). Several times slower than xxh3, so it caps a transfer's speed.
  Always available; the default on CPU without ``xxhash``.
Rates on the development CPU: docs/results/weight_transfer.md.
- ``"sum64"``: a positional checksum computed with torch ops on the tensor's own device (no copy to
  the host; used for CUDA IPC buckets). Bytes are zero-padded to a multiple of 8 and read as
  little-endian int64 words ``w_0..w_{n-1}``; the digest is ``S1 = sum_i w_i * (2i + 1)`` and
  ``S2 = sum_i w_i``, both mod 2^64, printed as 32 hex digits. Any change to a single word (so any
  flipped byte) changes S1: the word's weight is odd, hence invertible mod 2^64, so the difference
  ``delta * (2i + 1)`` cannot vanish. Words swapping places change S1 too. It is a corruption
  check, not a defence against a forger (neither is xxh3).

Digests cover bytes only; the manifest carries dtype and shape beside them and both are checked.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["ALGOS", "available_algos", "default_algo", "tensor_digest", "bytes_view", "check_algo"]

ALGOS = ("xxh3_128", "sha256", "sum64")
_SUM64_CHUNK_WORDS = 1 << 22  # 32 MiB of words per step: temporaries stay bounded on any device
_MASK = (1 << 64) - 1


def _xxhash():
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash


def available_algos() -> tuple[str, ...]:
    return tuple(a for a in ALGOS if a != "xxh3_128" or _xxhash() is not None)


def default_algo(device: str | torch.device = "cpu") -> str:
    """``sum64`` for CUDA tensors (hashing on the host would copy every byte across PCIe first);
    on CPU ``xxh3_128`` when the ``xxhash`` package is installed, else ``sha256``."""
    if torch.device(device).type == "cuda":
        return "sum64"
    return "xxh3_128" if _xxhash() is not None else "sha256"


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise ValueError(f"unknown digest algorithm {algo!r}: choose one of {ALGOS}")
    if algo not in available_algos():
        raise ValueError(f"digest algorithm {algo!r} needs the 'xxhash' package (pip install xxhash)")


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 1-D uint8 tensor on its device (a view when ``t`` is contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _sum64(b: torch.Tensor) -> str:
    """``b``: 1-D uint8 on any device."""
    n = b.numel()
    whole = n // 8
    dev = b.device
    s1 = torch.zeros((), dtype=torch.int64, device=dev)
    s2 = torch.zeros((), dtype=torch.int64, device=dev)
    if whole:
        head = b[: whole * 8]
        if head.data_ptr() % 8:  # int64 views need 8-byte alignment
            head = head.clone()
        words = head.view(torch.int64)
        for lo in range(0, whole, _SUM64_CHUNK_WORDS):
            w = words[lo: lo + _SUM64_CHUNK_WORDS]
            pos = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=dev).mul_(2).add_(1)
            # int64 arithmetic wraps mod 2^64 (two's complement), on CPU and CUDA alike
            s1 += (w * pos).sum()
            s2 += w.sum()
    if n % 8:
        tail = torch.zeros(8, dtype=torch.uint8, device=dev)
        tail[: n % 8] = b[whole * 8:]
        w = tail.view(torch.int64)[0]
        s1 += w * (2 * whole + 1)
        s2 += w
    a, c = (int(x) & _MASK for x in torch.stack([s1, s2]).tolist())
    return f"{a:016x}{c:016x}"


def tensor_digest(t: torch.Tensor, algo: str) -> str:
    """Hex digest of ``t``'s bytes (see the module docstring). ``sum64`` runs on ``t``'s device;
    the host algorithms copy a CUDA tensor to the host first."""
    b = bytes_view(t)
    if algo == "sum64":
        return _sum64(b)
    if b.device.type != "cpu":
        b = b.cpu()
    mv = memoryview(b.numpy()) if b.numel() else memoryview(b"")
    if algo == "xxh3_128":
        xx = _xxhash()
        if xx is None:
            check_algo(algo)
        return xx.xxh3_128(mv).hexdigest()
    if algo == "sha256":
        return hashlib.sha256(mv).hexdigest()
    check_algo(algo)
    raise AssertionError("unreachable")
