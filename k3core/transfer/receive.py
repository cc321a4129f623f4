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
from collections.abc import Mapping

import torch

from k3core.transfer.digest import ALGOS, available_algos, tensor_digest
from k3core.transfer.inprocess import engine_tensors
from k3core.transfer.shm import keep_mappings, map_segment
from k3core.transfer.stream import receive_stream
from k3core.transfer.verify import as_int, as_shape, check_expected, check_unchanged, need
from k3core.transfer.wire import (ALIGN, FORMAT, TransferError, bucket_digest, content_sha256, dtype_name, item_digest,
                                  parse_dtype)

__all__ = ["receive", "load_payload"]


def _map_cuda(bucket: dict, nbytes: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ipc = bucket.get("ipc")
    need(isinstance(ipc, dict), "malformed payload: a cuda_ipc bucket needs an 'ipc' object")
    if not torch.cuda.is_available():
        raise TransferError("a cuda_ipc payload needs CUDA in the receiving process")

    def b64(key: str, optional: bool = False) -> bytes | None:
        v = ipc.get(key)
        if v is None and optional:
            return None
        need(isinstance(v, str), f"malformed payload: ipc.{key} must be base64 text")
        return base64.b64decode(v)

    numel = as_int(ipc.get("numel"), "ipc.numel", 1)
    need(numel >= nbytes, f"CUDA bucket of {numel} bytes cannot hold the {nbytes} declared")
    try:
        return rebuild_cuda_tensor(torch.Tensor, torch.Size([numel]), (1,), as_int(ipc.get("tensor_offset"), "ipc.tensor_offset"),
                                   torch.storage.TypedStorage, torch.uint8, as_int(ipc.get("device"), "ipc.device"),
                                   b64("handle"), as_int(ipc.get("storage_size_bytes"), "ipc.storage_size_bytes"),
                                   as_int(ipc.get("storage_offset_bytes"), "ipc.storage_offset_bytes"), False,
                                   b64("ref_counter_handle"), as_int(ipc.get("ref_counter_offset"), "ipc.ref_counter_offset"),
                                   b64("event_handle", optional=True), bool(ipc.get("event_sync_required")))
    except TransferError:
        raise
    except Exception as e:  # an expired handle, a handle of this very process, another host's handle
        raise TransferError(f"cannot open the CUDA IPC bucket (sender gone, same process, or another host?): {e}") from None


def _view(buf: torch.Tensor, bucket_nbytes: int, off, nbytes, digest, algo: str, what: str,
          dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    off = as_int(off, f"{what} offset")
    nbytes = as_int(nbytes, f"{what} nbytes")
    need(off % ALIGN == 0, f"{what}: offset {off} is not {ALIGN}-byte aligned")
    need(nbytes == math.prod(shape) * dtype.itemsize,
         f"{what}: {nbytes} bytes declared, but {dtype_name(dtype)} {list(shape)} needs {math.prod(shape) * dtype.itemsize}")
    need(off + nbytes <= bucket_nbytes, f"{what}: bytes [{off}, {off + nbytes}) run past the bucket's {bucket_nbytes}")
    raw = buf[off: off + nbytes]
    need(isinstance(digest, str), f"malformed payload: {what} has no digest")
    got = tensor_digest(raw, algo)
    need(got == digest, f"{what}: {algo} digest {got} does not match the manifest's {digest} (corrupt bucket): refused")
    return raw.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype, device=buf.device)


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
    need(isinstance(payload, dict), f"malformed payload: expected a JSON object, got {type(payload).__name__}")
    need(payload.get("format") == FORMAT, f"malformed payload: format {payload.get('format')!r}, expected {FORMAT!r}")
    transport = payload.get("transport")
    if transport == "shm_stream":  # the tensors come back staged, never views: copy is moot
        return receive_stream(payload, current_version=current_version, expected=expected, base=base)
    need(transport in ("shm", "cuda_ipc"),
         f"malformed payload: transport {transport!r}, expected 'shm', 'shm_stream' or 'cuda_ipc'")
    version = as_int(payload.get("weight_version"), "weight_version", -(2**63))
    if current_version is not None and version <= current_version:
        raise TransferError(f"weight version {version} is not newer than the receiver's {current_version}: refused")
    algo = payload.get("hash")
    need(algo in ALGOS, f"malformed payload: hash {algo!r}, expected one of {ALGOS}")
    need(algo in available_algos(), f"payload digests use {algo!r}, which needs the 'xxhash' package here")
    buckets, unchanged = payload.get("buckets"), payload.get("unchanged", [])
    need(isinstance(buckets, list) and isinstance(unchanged, list), "malformed payload: 'buckets' and 'unchanged' must be lists")
    if unchanged:
        base_version = as_int(payload.get("base_version"), "base_version", -(2**63))
        if base is None:
            raise TransferError(f"delta payload (base version {base_version}): pass base= (the receiver's current tensors)")
        if current_version is not None and base_version != current_version:
            raise TransferError(f"delta computed against version {base_version}, but the receiver holds {current_version}: refused")

    pooled = payload.get("pooled") is True and transport == "shm"
    if pooled:
        keep_mappings({b.get("shm") for b in buckets if isinstance(b, dict)})
    out: dict[str, torch.Tensor] = {}
    rows = []
    for bi, bucket in enumerate(buckets):
        need(isinstance(bucket, dict) and isinstance(bucket.get("tensors"), list) and bucket["tensors"],
             f"malformed payload: bucket {bi} has no tensor list")
        ents = bucket["tensors"]
        need(bucket_digest(ents) == bucket.get("digest"), f"bucket {bi}: entry list does not match its digest: refused")
        nbytes = as_int(bucket.get("nbytes"), f"bucket {bi} nbytes")
        buf = map_segment(bucket.get("shm"), nbytes, pooled) if transport == "shm" else _map_cuda(bucket, nbytes)
        for e in ents:
            need(isinstance(e, dict) and isinstance(e.get("name"), str), f"malformed payload: bucket {bi} entry {e!r}")
            name = e["name"]
            need(name not in out, f"malformed payload: {name} sent twice")
            dtype, shape = parse_dtype(e.get("dtype")), as_shape(e.get("shape"), name)
            codec = e.get("codec", "raw")
            if codec == "raw":
                t = _view(buf, nbytes, e.get("offset"), e.get("nbytes"), e.get("digest"), algo, name, dtype, shape)
                digest = item_digest([e["digest"]])
            elif codec == "mxfp4":
                from k3core.ops import mxfp4

                need(len(shape) >= 1 and shape[-1] % mxfp4.BLOCK == 0 and dtype.is_floating_point,
                     f"{name}: MXFP4 entry needs a float dtype and a last dim divisible by {mxfp4.BLOCK}, got {list(shape)}")
                sc = e.get("scale")
                need(isinstance(sc, dict), f"malformed payload: {name} (mxfp4) has no scale part")
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
        check_unchanged(u, base, algo, out, rows, payload.get("base_version"))
    need(len(rows) == payload.get("num_tensors"), f"payload lists {len(rows)} tensors, its header says {payload.get('num_tensors')}")
    need(content_sha256(rows, algo) == payload.get("content_sha256"), "content digest does not match the entries: refused")
    if expected is not None:
        check_expected(out, expected)
    if copy:
        kept = {u["name"] for u in unchanged}
        out = {k: v if k in kept else v.clone() for k, v in out.items()}
    return out, version


def load_payload(engine, payload: dict, staging: dict | None = None) -> int:
    """``receive`` against ``engine`` (its version, its tensors as ``expected`` and delta ``base``),
    then ``engine.load_weights``. Returns the new version; raises ``TransferError`` with the engine
    untouched. ``staging``: for a streamed payload, a dict kept by the caller across transfers in
    which the staged tensors are allocated once and reused (``receive_stream``)."""
    own = engine_tensors(engine)
    if isinstance(payload, dict) and payload.get("transport") == "shm_stream":
        # staged copies, loaded before the sender hears "done": its wait() reports the load too
        _, version = receive_stream(payload, current_version=engine.weight_version, expected=own, base=own,
                                    apply=engine.load_weights, staging=staging)
        return version
    state, version = receive(payload, current_version=engine.weight_version, expected=own, base=own)
    engine.load_weights(state, version)
    return version
