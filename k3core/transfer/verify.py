"""Checks every receiving path applies, whatever the transport: ``receive.py`` (``shm``,
``cuda_ipc``) and ``stream.py`` (``shm_stream``) both build on them.

Owns: refusing a malformed payload field (``need``, ``as_int``, ``as_shape``), comparing what arrived
with what the receiver holds (``expected_spec``, ``check_expected``) and accepting a delta's
unchanged entries only when the receiver's own tensor has the digest the sender recorded
(``check_unchanged``). Every refusal is a ``TransferError``. Does not own: mapping the sender's
segments (``shm.py``), the payload formats (``shm.py``, ``stream.py``, ``wire.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from k3core.transfer.digest import tensor_digest
from k3core.transfer.wire import TransferError, dtype_name, parse_dtype

__all__ = ["need", "as_int", "as_shape", "expected_spec", "check_expected", "check_unchanged"]


def need(cond: bool, msg: str) -> None:
    """Refuse the transfer with ``msg`` unless ``cond``."""
    if not cond:
        raise TransferError(msg)


def as_int(x, what: str, lo: int = 0) -> int:
    """``x`` if it is an integer (not a bool) >= ``lo``, else a refusal naming ``what``."""
    need(isinstance(x, int) and not isinstance(x, bool) and x >= lo, f"malformed payload: {what} must be an integer >= {lo}, got {x!r}")
    return x


def as_shape(x, what: str) -> tuple[int, ...]:
    """``x`` as a shape if it is a list of non-negative integers, else a refusal naming ``what``."""
    need(isinstance(x, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in x),
         f"malformed payload: {what} shape must be a list of non-negative integers, got {x!r}")
    return tuple(x)


def expected_spec(v) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of an ``expected`` value: a tensor, or a (shape, dtype) pair."""
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    shape, dtype = v
    return tuple(shape), dtype


def check_unchanged(u, base: Mapping[str, torch.Tensor], algo: str, out: dict, rows: list, base_version) -> None:
    """A delta's unchanged entry: the receiver's own tensor must have the digest the sender recorded;
    it joins ``out`` and ``rows`` as is."""
    need(isinstance(u, dict) and isinstance(u.get("name"), str), f"malformed payload: unchanged entry {u!r}")
    name = u["name"]
    need(name not in out, f"malformed payload: {name} both sent and listed unchanged")
    need(name in base, f"delta refused: the receiver has no {name} to keep")
    own = base[name]
    dtype, shape = parse_dtype(u.get("dtype")), as_shape(u.get("shape"), name)
    need(u.get("codec", "raw") == "raw", f"delta refused: {name}: only raw tensors can stay unchanged")
    need(own.dtype == dtype and tuple(own.shape) == shape,
         f"delta refused: {name} is {dtype_name(own.dtype)} {list(own.shape)} here, the sender's is {dtype_name(dtype)} {list(shape)}")
    got = tensor_digest(own, algo)
    need(got == u.get("digest"), f"delta refused: the receiver's {name} does not match the sender's record of "
                                 f"version {base_version} ({got} != {u.get('digest')})")
    out[name] = own
    rows.append((name, dtype_name(dtype), list(shape), "raw", u["digest"]))


def check_expected(out: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor | tuple]) -> None:
    """Exactly ``expected``'s names, shapes and dtypes."""
    missing, extra = sorted(set(expected) - set(out)), sorted(set(out) - set(expected))
    need(not missing and not extra, f"name set differs from the receiver's: missing {missing[:3]}, unexpected {extra[:3]}: refused")
    for name, t in out.items():
        shape, dtype = expected_spec(expected[name])
        need(tuple(t.shape) == shape, f"{name}: shape {list(t.shape)}, the receiver expects {list(shape)}: refused")
        need(t.dtype == dtype, f"{name}: dtype {dtype_name(t.dtype)}, the receiver expects {dtype_name(dtype)}: refused")
