"""The cross-process transfer between GPU processes on one host: buckets in GPU memory, shared by CUDA IPC.

Owns both ends of the ``"cuda_ipc"`` transport: ``send_cuda_ipc`` writes a trainer state into CUDA
uint8 buckets of at most ``bucket_bytes`` (a tensor larger than that gets a bucket of its own) and
returns a ``SentTransfer`` whose JSON ``payload`` the receiving process turns back into a verified
state dict with ``receive_cuda_ipc`` (through ``receive`` / ``load_payload``, ``receive.py``). Does
not own: the checks shared with the streamed path (``verify.py``), the wire items (``wire.py``).
Payload::

    {"format": "k3rl.weights/1", "transport": "cuda_ipc", "weight_version": int, "hash": algo,
     "content_sha256": hex, "num_tensors": int,
     "buckets": [{"ipc": {...}, "nbytes": int, "digest": hex, "tensors": [entry, ...]}]}  # entries: wire.py

Why buckets and not the ring: the bytes never leave GPU memory (no host copy on either side), and
a GPU-to-GPU copy is fast enough that flow control would only add round trips; the price is one
wire copy of the weights in the sender's GPU memory while the transfer is open.

Handles: ``torch.multiprocessing.reductions.reduce_tensor``'s arguments for each bucket, written as
JSON (base64 for the handles), never pickled: a payload is data, not code. CUDA IPC does not work
within one process; the receiver must be another process on the same host. The default digest is
``sum64``, computed on the GPU (``digest.py``).

Lifetimes (the sender owns every bucket): the sender fills and shares all buckets, then hands the
payload over; the receiver opens the buckets, verifies every digest and returns tensors that are
views of them (``load_payload`` copies them into the engine); once the receiver has answered, the
sender calls ``SentTransfer.close()``, which drops the buckets (the memory goes back once the
receiver's views are gone too). The sender must not write to a bucket after handing the payload.
"""

from __future__ import annotations

import base64
import time
import weakref
from collections.abc import Mapping

import torch

from k3core.transfer.digest import check_algo, default_algo, tensor_digest
from k3core.transfer.verify import (as_int, check_content, check_declared, check_digest, check_expected, check_header,
                                    decode_parts, need, parse_entry, part_nbytes, wire_parts)
from k3core.transfer.wire import (ALIGN, DEFAULT_BUCKET_BYTES, FORMAT, ROUTED_EXPERT_SUFFIXES, TransferError,
                                  TransferReport, align_up, bucket_digest, content_sha256, dtype_name, item_digest,
                                  iter_wire)

__all__ = ["TRANSPORT", "SentTransfer", "send_cuda_ipc", "receive_cuda_ipc"]

TRANSPORT = "cuda_ipc"


# ------------------------------------------------------------------ sender
def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _share(buf: torch.Tensor) -> dict:
    """The IPC description of one bucket. Called after every write: the IPC event is recorded at
    share time, and the caller's synchronize before it makes the bytes visible whatever the
    receiver's stream."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    fn, args = reduce_tensor(buf)
    if fn is not rebuild_cuda_tensor:
        raise RuntimeError(f"reduce_tensor gave {fn}, expected rebuild_cuda_tensor")
    (_, size, stride, t_off, storage_cls, dtype, dev, handle, s_bytes, s_off, _, rc_handle, rc_off,
     ev_handle, ev_sync) = args
    if storage_cls is not torch.storage.TypedStorage or dtype != torch.uint8 or tuple(stride) != (1,):
        raise RuntimeError(f"unexpected CUDA IPC share of a bucket: {storage_cls}, {dtype}, stride {stride}")
    return {"device": int(dev), "numel": int(size[0]), "tensor_offset": int(t_off), "handle": _b64(handle),
            "storage_size_bytes": int(s_bytes), "storage_offset_bytes": int(s_off),
            "ref_counter_handle": _b64(rc_handle), "ref_counter_offset": int(rc_off),
            "event_handle": _b64(ev_handle), "event_sync_required": bool(ev_sync)}


def _drop(buffers: list[torch.Tensor]) -> None:
    buffers.clear()
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # free blocks whose receivers have let go


class SentTransfer:
    """The sender's handle on one CUDA IPC transfer: ``payload`` to hand over, ``report`` of the
    send, and the buckets, kept until ``close()`` (idempotent; also run on garbage collection)."""

    def __init__(self, payload: dict, report: TransferReport, buffers: list[torch.Tensor]):
        self.payload, self.report = payload, report
        self._buffers = buffers
        self._finalizer = weakref.finalize(self, _drop, self._buffers)

    def close(self) -> None:
        """Drop the buckets: call once the receiver has answered (loaded or refused)."""
        self._finalizer()

    def __enter__(self) -> SentTransfer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write(buf: torch.Tensor, offset: int, t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    if n:
        buf[offset: offset + n].view(t.dtype).view(t.shape).copy_(t)
    return n


def _upper_bound(named_tensors: Mapping[str, torch.Tensor], quantize_experts: bool) -> int:
    """Aligned wire bytes still to come, from shapes alone: a last bucket need not be a full one."""
    total = 0
    for name, t in named_tensors.items():
        n = t.numel()
        if quantize_experts and name.endswith(ROUTED_EXPERT_SUFFIXES):
            total += align_up(n // 2) + align_up(n // 32)
        else:
            total += align_up(n * t.element_size())
    return total


@torch.no_grad()
def send_cuda_ipc(named_tensors: Mapping[str, torch.Tensor], version: int, *, device: str | torch.device | None = None,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, quantize_experts: bool = False, w4a8: bool = True,
                  algo: str | None = None) -> SentTransfer:
    """Write ``named_tensors`` into CUDA buckets on ``device`` (default: the current CUDA device) and
    share them by CUDA IPC handle. The receiver must be another process on this host.
    ``quantize_experts``/``w4a8``: see ``wire.py``. ``algo``: digest algorithm (default ``sum64``,
    computed on the GPU)."""
    if not torch.cuda.is_available():
        raise RuntimeError("send_cuda_ipc needs CUDA; use send_shm_stream on CPU")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    algo = algo or default_algo(dev)
    check_algo(algo)
    t0 = time.perf_counter()
    remaining = _upper_bound(named_tensors, quantize_experts)
    buffers: list[torch.Tensor] = []
    entries: list[list[dict]] = []
    used: list[int] = []
    rows = []
    nbytes = 0
    try:
        for item in iter_wire(named_tensors, quantize_experts, w4a8):
            size = sum(align_up(p.numel() * p.element_size()) for p in item.parts())
            if not buffers or used[-1] + size > buffers[-1].numel():
                buffers.append(torch.empty(max(min(bucket_bytes, remaining), size, 1), dtype=torch.uint8, device=dev))
                entries.append([])
                used.append(0)
            buf, off = buffers[-1], used[-1]
            entry = {"name": item.name, "dtype": dtype_name(item.dtype), "shape": list(item.shape), "offset": off,
                     "nbytes": _write(buf, off, item.data)}
            entry["digest"] = tensor_digest(buf[off: off + entry["nbytes"]], algo)  # of the bucket's own bytes
            off = align_up(off + entry["nbytes"])
            digests = [entry["digest"]]
            if item.codec == "mxfp4":
                n = _write(buf, off, item.scale)
                entry["codec"] = "mxfp4"
                entry["scale"] = {"offset": off, "nbytes": n, "digest": tensor_digest(buf[off: off + n], algo)}
                digests.append(entry["scale"]["digest"])
                off = align_up(off + n)
            entries[-1].append(entry)
            rows.append((item.name, dtype_name(item.dtype), list(item.shape), item.codec, item_digest(digests)))
            used[-1] = off
            remaining -= size
            nbytes += item.nbytes()
        torch.cuda.synchronize(dev)
        shared = [_share(buf) for buf in buffers]
    except BaseException:
        _drop(buffers)
        raise
    payload_buckets = []
    for ipc, ents in zip(shared, entries):
        end = max((e["scale"]["offset"] + e["scale"]["nbytes"]) if "scale" in e else (e["offset"] + e["nbytes"])
                  for e in ents)
        payload_buckets.append({"ipc": ipc, "nbytes": end, "digest": bucket_digest(ents), "tensors": ents})
    content = content_sha256(rows, algo)
    payload = {"format": FORMAT, "transport": TRANSPORT, "weight_version": int(version), "hash": algo,
               "content_sha256": content, "num_tensors": len(rows), "buckets": payload_buckets}
    report = TransferReport(TRANSPORT, int(version), algo, content, len(rows), nbytes, time.perf_counter() - t0,
                            len(buffers))
    return SentTransfer(payload, report, buffers)


# ------------------------------------------------------------------ receiver
def _open_bucket(bucket: dict, nbytes: int) -> torch.Tensor:
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


def _part(buf: torch.Tensor, bucket_nbytes: int, where, want_nbytes: int, what: str) -> tuple[torch.Tensor, str]:
    """The bytes of one part, bounds and alignment checked, and the digest the manifest gives them."""
    need(isinstance(where, dict), f"malformed payload: {what} has no offset/nbytes")
    off, n = as_int(where.get("offset"), f"{what} offset"), as_int(where.get("nbytes"), f"{what} nbytes")
    need(off % ALIGN == 0, f"{what}: offset {off} is not {ALIGN}-byte aligned")
    need(n == want_nbytes, f"{what}: {n} bytes declared, but its dtype and shape need {want_nbytes}")
    need(off + n <= bucket_nbytes, f"{what}: bytes [{off}, {off + n}) run past the bucket's {bucket_nbytes}")
    return buf[off: off + n], where.get("digest")


@torch.no_grad()
def receive_cuda_ipc(payload: dict, *, current_version: int | None = None,
                     expected: Mapping[str, torch.Tensor | tuple] | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """Open and verify a ``send_cuda_ipc`` payload; return (state dict, weight version). Arguments as
    ``receive``. Raw tensors are views of the sender's buckets (no copy); MXFP4-codec entries come
    back dequantised, in their float dtype. Raises ``TransferError``."""
    version, algo = check_header(payload, TRANSPORT, current_version)
    buckets = payload.get("buckets")
    need(isinstance(buckets, list), "malformed payload: 'buckets' must be a list")
    out: dict[str, torch.Tensor] = {}
    rows = []
    for bi, bucket in enumerate(buckets):
        need(isinstance(bucket, dict) and isinstance(bucket.get("tensors"), list) and bucket["tensors"],
             f"malformed payload: bucket {bi} has no tensor list")
        ents = bucket["tensors"]
        need(bucket_digest(ents) == bucket.get("digest"), f"bucket {bi}: entry list does not match its digest: refused")
        nbytes = as_int(bucket.get("nbytes"), f"bucket {bi} nbytes")
        buf = _open_bucket(bucket, nbytes)
        for e in ents:
            name, dtype, shape, codec = parse_entry(e)
            need(name not in out, f"malformed payload: {name} sent twice")
            check_declared(name, dtype, shape, expected)
            specs = wire_parts(name, dtype, shape, codec)
            wheres = [e] if codec == "raw" else [e, e.get("scale")]
            parts, digests = [], []
            for what, where, (d, s) in zip(("", " (scale)"), wheres, specs):
                raw, want = _part(buf, nbytes, where, part_nbytes(d, s), name + what)
                digests.append(check_digest(raw, want, algo, name + what))
                parts.append(raw)
            out[name] = decode_parts(parts, dtype, shape, codec)
            rows.append((name, dtype_name(dtype), list(shape), codec, item_digest(digests)))
    check_content(rows, algo, payload.get("num_tensors"), payload.get("content_sha256"))
    if expected is not None:
        check_expected(out, expected)
    return out, version
