"""The checks every receiving path applies, whatever the transport: ``stream.py`` (``shm_stream``) and
``cuda_ipc.py`` (``cuda_ipc``) both build on them, so a rule holds on both or on neither.

Owns: refusing a malformed payload field (``need``, ``as_int``, ``as_shape``), the payload header
(``check_header``: format, transport, a version newer than the receiver's, a digest algorithm this
process can compute), the entry rules of each codec (``wire_parts``: the parts an item travels as,
and what a ``raw`` or ``mxfp4`` entry must declare; ``decode_parts``: those parts back to the tensor
the receiver returns), a part's digest (``check_digest``), one declared item against what the
receiver holds (``check_declared``), and the whole set at the end (``check_expected``,
``check_content``). Every refusal is a ``TransferError``. Does not own: mapping the sender's memory
(``segments.py``, ``cuda_ipc.py``), the wire format (``wire.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from k3core.transfer.digest import ALGOS, available_algos, tensor_digest
from k3core.transfer.wire import FORMAT, TransferError, content_sha256, dtype_name, parse_dtype

__all__ = ["need", "as_int", "as_shape", "check_header", "parse_entry", "wire_parts", "part_nbytes", "decode_parts", "check_digest",
           "expected_spec", "check_declared", "check_expected", "check_content"]

MIN_VERSION = -(2**63)


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


def check_header(payload, transport: str, current_version: int | None) -> tuple[int, str]:
    """(weight version, digest algorithm) of a ``transport`` payload; refuses a wrong format or
    transport, a version not newer than ``current_version``, an algorithm this process lacks."""
    need(isinstance(payload, dict) and payload.get("format") == FORMAT and payload.get("transport") == transport,
         f"malformed payload: expected a {FORMAT} {transport} object")
    version = as_int(payload.get("weight_version"), "weight_version", MIN_VERSION)
    if current_version is not None and version <= current_version:
        raise TransferError(f"weight version {version} is not newer than the receiver's {current_version}: refused")
    algo = payload.get("hash")
    need(algo in ALGOS, f"malformed payload: hash {algo!r}, expected one of {ALGOS}")
    need(algo in available_algos(), f"payload digests use {algo!r}, which needs the 'xxhash' package here")
    return version, algo


def parse_entry(decl) -> tuple[str, torch.dtype, tuple[int, ...], str]:
    """(name, dtype, shape, codec) of a declared item: an object with a string name, a known dtype,
    a shape and a codec (``raw`` when absent)."""
    need(isinstance(decl, dict) and isinstance(decl.get("name"), str), f"malformed payload: item {str(decl)[:200]}")
    name = decl["name"]
    return name, parse_dtype(decl.get("dtype")), as_shape(decl.get("shape"), name), decl.get("codec", "raw")


def wire_parts(name: str, dtype: torch.dtype, shape: tuple[int, ...], codec: str) -> list[tuple[torch.dtype, tuple]]:
    """(dtype, shape) of each part an item travels as: ``raw``, the tensor itself; ``mxfp4`` (a float
    tensor whose last dim is a whole number of MXFP4 blocks), its packed codes then its scales, both
    uint8. Anything else is refused."""
    if codec == "raw":
        return [(dtype, shape)]
    if codec == "mxfp4":
        from k3core.ops import mxfp4

        need(len(shape) >= 1 and shape[-1] % mxfp4.BLOCK == 0 and dtype.is_floating_point,
             f"{name}: MXFP4 entry needs a float dtype and a last dim divisible by {mxfp4.BLOCK}, got "
             f"{dtype_name(dtype)} {list(shape)}")
        return [(torch.uint8, (*shape[:-1], shape[-1] // 2)), (torch.uint8, (*shape[:-1], shape[-1] // mxfp4.BLOCK))]
    raise TransferError(f"{name}: unknown codec {codec!r}")


def part_nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def decode_parts(parts: list[torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...], codec: str) -> torch.Tensor:
    """The tensor the receiver returns from an item's verified parts (``wire_parts``' layout, each
    given as its bytes): ``raw``, a view of the bytes; ``mxfp4``, dequantised into ``dtype``."""
    specs = wire_parts("item", dtype, shape, codec)
    views = [p.view(d).view(s) if p.numel() else torch.empty(s, dtype=d, device=p.device)
             for p, (d, s) in zip(parts, specs)]
    if codec == "mxfp4":
        from k3core.ops import mxfp4

        return mxfp4.dequantize(views[0], views[1], dtype)
    return views[0]


def check_digest(part: torch.Tensor, want, algo: str, what: str) -> str:
    """``part``'s digest when it is ``want``; else a refusal naming ``what`` (a corrupt bucket)."""
    need(isinstance(want, str), f"malformed payload: {what} has no digest")
    got = tensor_digest(part, algo)
    # the computed digest stays out of the message: it would tell a payload's sender about bytes it named
    need(got == want, f"{what}: its {algo} digest does not match the sender's {want} (corrupt bucket): refused")
    return got


def expected_spec(v) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of an ``expected`` value: a tensor, or a (shape, dtype) pair."""
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    shape, dtype = v
    return tuple(shape), dtype


def check_declared(name: str, dtype: torch.dtype, shape: tuple[int, ...],
                   expected: Mapping[str, torch.Tensor | tuple] | None) -> None:
    """One arriving item against the receiver's tensor of that name (nothing to check without ``expected``)."""
    if expected is None:
        return
    need(name in expected, f"{name}: not a tensor of the receiver: refused")
    want_shape, want_dtype = expected_spec(expected[name])
    need(tuple(shape) == tuple(want_shape), f"{name}: shape {list(shape)}, the receiver expects {list(want_shape)}: refused")
    need(dtype == want_dtype, f"{name}: dtype {dtype_name(dtype)}, the receiver expects {dtype_name(want_dtype)}: refused")


def check_expected(out: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor | tuple]) -> None:
    """Exactly ``expected``'s names, shapes and dtypes."""
    missing, extra = sorted(set(expected) - set(out)), sorted(set(out) - set(expected))
    need(not missing and not extra, f"name set differs from the receiver's: missing {missing[:3]}, unexpected {extra[:3]}: refused")
    for name, t in out.items():
        check_declared(name, t.dtype, tuple(t.shape), expected)


def check_content(rows: list, algo: str, num_tensors, content) -> None:
    """The sender's count and content digest over (name, dtype, shape, codec, digest) of every item."""
    need(len(rows) == num_tensors, f"the transfer carried {len(rows)} tensors, the sender says {num_tensors!r}")
    need(content_sha256(rows, algo) == content, "content digest does not match the entries: refused")
