"""The receiving side of a shared-memory / CUDA IPC transfer: payload -> verified state dict.

Owns: ``receive(payload)`` (what ``/update_weights_from_tensor`` calls) and ``load_payload(engine,
payload)`` (receive with the engine's version, names, shapes, dtypes and current tensors as the
reference, then ``engine.load_weights``). Does not own: the payload format (``shm.py``, ``wire.py``),
the streamed transport (``stream.py``: ``receive`` and ``load_payload`` hand ``"shm_stream"`` payloads
to it; the same checks apply, and its tensors are staged copies, never views).

Everything is checked before anything is returned, so a refused transfer never reaches the engine
and the previous version keeps serving: the payload's structure; the version (newer than
``current_version``; a delta's base equal to it); every bucket's digest over its entries; every
entry's bounds, alignment, dtype, shape and byte count; every tensor's content digest; for a delta,
that each unchanged tensor the receiver holds has the digest the sender recorded; the names, shapes
and dtypes against ``expected``; and the content digest over all of it. Any failure raises
``TransferError``.

Returned tensors are views of the mapped buckets (no copy; ``copy=True`` clones them): valid after
the sender unlinks the segments, until the receiver drops them; for a pooled transfer
(``"pooled": true``, the sender reuses its segments) only until the receiver acknowledges. The
mappings of pooled segments are cached between transfers (``forget_mappings`` drops them). MXFP4 entries (``codec: "mxfp4"``)
come back dequantised, in their float dtype.
"""

from __future__ import annotations

import base64
import math
import os
import re
import threading
from typing import Mapping

import torch

from k3core.transfer.digest import ALGOS, available_algos, tensor_digest
from k3core.transfer.wire import (ALIGN, FORMAT, TransferError, bucket_digest, content_sha256, dtype_name, item_digest,
                                  parse_dtype)

__all__ = ["receive", "load_payload", "forget_mappings"]

_SHM_NAME = re.compile(r"^k3xfer-[0-9A-Za-z-]{1,200}$")


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise TransferError(msg)


def _int(x, what: str, lo: int = 0) -> int:
    _need(isinstance(x, int) and not isinstance(x, bool) and x >= lo, f"malformed payload: {what} must be an integer >= {lo}, got {x!r}")
    return x


def _shape(x, what: str) -> tuple[int, ...]:
    _need(isinstance(x, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in x),
          f"malformed payload: {what} shape must be a list of non-negative integers, got {x!r}")
    return tuple(x)


# Mappings of pooled segments (a sender's ShmPool refills the same segments every transfer), kept
# between transfers so steady-state receives do not fault every page in again: name -> (identity of
# the file, its mapping). Dropped for segments a payload no longer names, or by forget_mappings().
_POOLED: dict[str, tuple[tuple[int, int, int], torch.Tensor]] = {}
_POOLED_LOCK = threading.Lock()  # a server may receive from several threads


def forget_mappings() -> None:
    """Drop the cached mappings of pooled segments (they pin the segments' memory until dropped)."""
    with _POOLED_LOCK:
        _POOLED.clear()


def _keep_mappings(names: set) -> None:
    """Drop the cached mappings of pooled segments not in ``names`` (the sender no longer uses them)."""
    with _POOLED_LOCK:
        for name in set(_POOLED) - names:
            del _POOLED[name]


def _map_shm(bucket: dict, nbytes: int, pooled: bool) -> torch.Tensor:
    from k3core.transfer.shm import SHM_DIR

    name = bucket.get("shm")
    _need(isinstance(name, str) and bool(_SHM_NAME.match(name)),
          f"malformed payload: shared-memory name {name!r} is not a k3xfer-* segment name")
    path = os.path.join(SHM_DIR, name)
    try:
        st = os.stat(path)
        ident = (st.st_dev, st.st_ino, st.st_size)
        with _POOLED_LOCK:
            hit = _POOLED.get(name) if pooled else None
        if hit is not None and hit[0] == ident:
            buf = hit[1]
        else:
            # MAP_PRIVATE, opened read-only: the receiver can never write into the sender's bucket
            # (a write would only diverge its own copy, which the next digest check then refuses)
            buf = torch.from_file(path, shared=False, size=max(st.st_size, 1), dtype=torch.uint8)
            if pooled:
                with _POOLED_LOCK:
                    _POOLED[name] = (ident, buf)
    except (OSError, RuntimeError) as e:
        raise TransferError(f"shared-memory segment {name} is missing (did the sender close the transfer before "
                            f"the receiver loaded it?): {e}") from None
    _need(buf.numel() >= nbytes, f"shared-memory segment {name} has {buf.numel()} bytes, the payload declares {nbytes}")
    return buf


def _map_cuda(bucket: dict, nbytes: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ipc = bucket.get("ipc")
    _need(isinstance(ipc, dict), "malformed payload: a cuda_ipc bucket needs an 'ipc' object")
    if not torch.cuda.is_available():
        raise TransferError("a cuda_ipc payload needs CUDA in the receiving process")

    def b64(key: str, optional: bool = False) -> bytes | None:
        v = ipc.get(key)
        if v is None and optional:
            return None
        _need(isinstance(v, str), f"malformed payload: ipc.{key} must be base64 text")
        return base64.b64decode(v)

    numel = _int(ipc.get("numel"), "ipc.numel", 1)
    _need(numel >= nbytes, f"CUDA bucket of {numel} bytes cannot hold the {nbytes} declared")
    try:
        return rebuild_cuda_tensor(torch.Tensor, torch.Size([numel]), (1,), _int(ipc.get("tensor_offset"), "ipc.tensor_offset"),
                                   torch.storage.TypedStorage, torch.uint8, _int(ipc.get("device"), "ipc.device"),
                                   b64("handle"), _int(ipc.get("storage_size_bytes"), "ipc.storage_size_bytes"),
                                   _int(ipc.get("storage_offset_bytes"), "ipc.storage_offset_bytes"), False,
                                   b64("ref_counter_handle"), _int(ipc.get("ref_counter_offset"), "ipc.ref_counter_offset"),
                                   b64("event_handle", optional=True), bool(ipc.get("event_sync_required")))
    except TransferError:
        raise
    except Exception as e:  # an expired handle, a handle of this very process, another host's handle
        raise TransferError(f"cannot open the CUDA IPC bucket (sender gone, same process, or another host?): {e}") from None


def _view(buf: torch.Tensor, bucket_nbytes: int, off, nbytes, digest, algo: str, what: str,
          dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    off = _int(off, f"{what} offset")
    nbytes = _int(nbytes, f"{what} nbytes")
    _need(off % ALIGN == 0, f"{what}: offset {off} is not {ALIGN}-byte aligned")
    _need(nbytes == math.prod(shape) * dtype.itemsize,
          f"{what}: {nbytes} bytes declared, but {dtype_name(dtype)} {list(shape)} needs {math.prod(shape) * dtype.itemsize}")
    _need(off + nbytes <= bucket_nbytes, f"{what}: bytes [{off}, {off + nbytes}) run past the bucket's {bucket_nbytes}")
    raw = buf[off: off + nbytes]
    _need(isinstance(digest, str), f"malformed payload: {what} has no digest")
    got = tensor_digest(raw, algo)
    _need(got == digest, f"{what}: {algo} digest {got} does not match the manifest's {digest} (corrupt bucket): refused")
    return raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype, device=buf.device)


def _expected_spec(v) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    shape, dtype = v
    return tuple(shape), dtype


def _check_unchanged(u, base: Mapping[str, torch.Tensor], algo: str, out: dict, rows: list, base_version) -> None:
    """A delta's unchanged entry: the receiver's own tensor must have the digest the sender recorded;
    it joins ``out`` and ``rows`` as is."""
    _need(isinstance(u, dict) and isinstance(u.get("name"), str), f"malformed payload: unchanged entry {u!r}")
    name = u["name"]
    _need(name not in out, f"malformed payload: {name} both sent and listed unchanged")
    _need(name in base, f"delta refused: the receiver has no {name} to keep")
    own = base[name]
    dtype, shape = parse_dtype(u.get("dtype")), _shape(u.get("shape"), name)
    _need(u.get("codec", "raw") == "raw", f"delta refused: {name}: only raw tensors can stay unchanged")
    _need(own.dtype == dtype and tuple(own.shape) == shape,
          f"delta refused: {name} is {dtype_name(own.dtype)} {list(own.shape)} here, the sender's is {dtype_name(dtype)} {list(shape)}")
    got = tensor_digest(own, algo)
    _need(got == u.get("digest"), f"delta refused: the receiver's {name} does not match the sender's record of "
                                  f"version {base_version} ({got} != {u.get('digest')})")
    out[name] = own
    rows.append((name, dtype_name(dtype), list(shape), "raw", u["digest"]))


def _check_expected(out: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor | tuple]) -> None:
    """Exactly ``expected``'s names, shapes and dtypes."""
    missing, extra = sorted(set(expected) - set(out)), sorted(set(out) - set(expected))
    _need(not missing and not extra, f"name set differs from the receiver's: missing {missing[:3]}, unexpected {extra[:3]}: refused")
    for name, t in out.items():
        shape, dtype = _expected_spec(expected[name])
        _need(tuple(t.shape) == shape, f"{name}: shape {list(t.shape)}, the receiver expects {list(shape)}: refused")
        _need(t.dtype == dtype, f"{name}: dtype {dtype_name(t.dtype)}, the receiver expects {dtype_name(dtype)}: refused")


@torch.no_grad()
def receive(payload: dict, *, current_version: int | None = None,
            expected: Mapping[str, torch.Tensor | tuple] | None = None,
            base: Mapping[str, torch.Tensor] | None = None,
            copy: bool = False) -> tuple[dict[str, torch.Tensor], int]:
    """Map and verify a transfer payload; return (state dict, weight version).

    ``current_version``: the receiver's version; the payload's must be newer, and a delta's base must
    equal it. ``expected``: name -> tensor (or (shape, dtype)) the result must match exactly (the
    engine's own tensors). ``base``: the receiver's current tensors, needed for a delta: each
    unchanged tensor is hashed and must have the sender's digest, and is returned as is (no copy).
    ``copy``: clone the received tensors out of the buckets. Raises ``TransferError``.
    """
    _need(isinstance(payload, dict), f"malformed payload: expected a JSON object, got {type(payload).__name__}")
    _need(payload.get("format") == FORMAT, f"malformed payload: format {payload.get('format')!r}, expected {FORMAT!r}")
    transport = payload.get("transport")
    if transport == "shm_stream":  # the tensors come back staged, never views: copy is moot
        from k3core.transfer.stream import receive_stream

        return receive_stream(payload, current_version=current_version, expected=expected, base=base)
    _need(transport in ("shm", "cuda_ipc"),
          f"malformed payload: transport {transport!r}, expected 'shm', 'shm_stream' or 'cuda_ipc'")
    version = _int(payload.get("weight_version"), "weight_version", -(2**63))
    if current_version is not None and version <= current_version:
        raise TransferError(f"weight version {version} is not newer than the receiver's {current_version}: refused")
    algo = payload.get("hash")
    _need(algo in ALGOS, f"malformed payload: hash {algo!r}, expected one of {ALGOS}")
    _need(algo in available_algos(), f"payload digests use {algo!r}, which needs the 'xxhash' package here")
    buckets, unchanged = payload.get("buckets"), payload.get("unchanged", [])
    _need(isinstance(buckets, list) and isinstance(unchanged, list), "malformed payload: 'buckets' and 'unchanged' must be lists")
    if unchanged:
        base_version = _int(payload.get("base_version"), "base_version", -(2**63))
        if base is None:
            raise TransferError(f"delta payload (base version {base_version}): pass base= (the receiver's current tensors)")
        if current_version is not None and base_version != current_version:
            raise TransferError(f"delta computed against version {base_version}, but the receiver holds {current_version}: refused")

    pooled = payload.get("pooled") is True and transport == "shm"
    if pooled:
        _keep_mappings({b.get("shm") for b in buckets if isinstance(b, dict)})
    out: dict[str, torch.Tensor] = {}
    rows = []
    for bi, bucket in enumerate(buckets):
        _need(isinstance(bucket, dict) and isinstance(bucket.get("tensors"), list) and bucket["tensors"],
              f"malformed payload: bucket {bi} has no tensor list")
        ents = bucket["tensors"]
        _need(bucket_digest(ents) == bucket.get("digest"), f"bucket {bi}: entry list does not match its digest: refused")
        nbytes = _int(bucket.get("nbytes"), f"bucket {bi} nbytes")
        buf = _map_shm(bucket, nbytes, pooled) if transport == "shm" else _map_cuda(bucket, nbytes)
        for e in ents:
            _need(isinstance(e, dict) and isinstance(e.get("name"), str), f"malformed payload: bucket {bi} entry {e!r}")
            name = e["name"]
            _need(name not in out, f"malformed payload: {name} sent twice")
            dtype, shape = parse_dtype(e.get("dtype")), _shape(e.get("shape"), name)
            codec = e.get("codec", "raw")
            if codec == "raw":
                t = _view(buf, nbytes, e.get("offset"), e.get("nbytes"), e.get("digest"), algo, name, dtype, shape)
                digest = item_digest([e["digest"]])
            elif codec == "mxfp4":
                from k3core.ops import mxfp4

                _need(len(shape) >= 1 and shape[-1] % mxfp4.BLOCK == 0 and dtype.is_floating_point,
                      f"{name}: MXFP4 entry needs a float dtype and a last dim divisible by {mxfp4.BLOCK}, got {list(shape)}")
                sc = e.get("scale")
                _need(isinstance(sc, dict), f"malformed payload: {name} (mxfp4) has no scale part")
                packed = _view(buf, nbytes, e.get("offset"), e.get("nbytes"), e.get("digest"), algo, name + " (packed)",
                               torch.uint8, (*shape[:-1], shape[-1] // 2))
                scale = _view(buf, nbytes, sc.get("offset"), sc.get("nbytes"), sc.get("digest"), algo, name + " (scale)",
                              torch.uint8, (*shape[:-1], shape[-1] // mxfp4.BLOCK))
                t = mxfp4.dequantize(packed, scale, dtype)
                digest = item_digest([e["digest"], sc["digest"]])
            else:
                raise TransferError(f"{name}: unknown codec {codec!r}")
            out[name] = t
            rows.append((name, dtype_name(dtype), list(shape), codec, digest))
    for u in unchanged:
        _check_unchanged(u, base, algo, out, rows, payload.get("base_version"))
    _need(len(rows) == payload.get("num_tensors"), f"payload lists {len(rows)} tensors, its header says {payload.get('num_tensors')}")
    _need(content_sha256(rows, algo) == payload.get("content_sha256"), "content digest does not match the entries: refused")
    if expected is not None:
        _check_expected(out, expected)
    if copy:
        kept = {u["name"] for u in unchanged}
        out = {k: v if k in kept else v.clone() for k, v in out.items()}
    return out, version


def load_payload(engine, payload: dict, staging: dict | None = None) -> int:
    """``receive`` against ``engine`` (its version, its tensors as ``expected`` and delta ``base``),
    then ``engine.load_weights``. Returns the new version; raises ``TransferError`` with the engine
    untouched. ``staging``: for a streamed payload, a dict kept by the caller across transfers in
    which the staged tensors are allocated once and reused (``receive_stream``)."""
    from k3core.transfer.inprocess import engine_tensors

    own = engine_tensors(engine)
    if isinstance(payload, dict) and payload.get("transport") == "shm_stream":
        from k3core.transfer.stream import receive_stream

        # staged copies, loaded before the sender hears "done": its wait() reports the load too
        _, version = receive_stream(payload, current_version=engine.weight_version, expected=own, base=own,
                                    apply=engine.load_weights, staging=staging)
        return version
    state, version = receive(payload, current_version=engine.weight_version, expected=own, base=own)
    engine.load_weights(state, version)
    return version
