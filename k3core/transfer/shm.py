"""Same-host weight transfer across processes: buckets in shared memory (CPU) or CUDA IPC (GPU).

Owns the sending side: ``send_shm`` and ``send_cuda_ipc`` write a trainer state into buckets of at
most ``bucket_bytes`` (a tensor larger than that gets a bucket of its own) and return a
``SentTransfer`` whose ``payload`` is a JSON-serialisable manifest; the receiving process calls
``k3core.transfer.receive(payload)`` (``receive.py``). Also the segments themselves, for both ends:
their names, creating them (``create_segment``, ``ShmPool``) and the receiver's read-only mapping
(``map_segment``, used by ``receive.py`` and ``stream.py``). Payload::

    {"format": "k3rl.weights/1", "transport": "shm" | "cuda_ipc", "weight_version": int,
     "base_version": int | None, "hash": "xxh3_128" | "sha256" | "sum64", "content_sha256": hex,
     "num_tensors": int, "pooled": bool,   # pooled: the segments are refilled by later transfers
     "buckets": [{"shm": name | "ipc": {...}, "nbytes": int, "digest": hex,
                  "tensors": [entry, ...]}],          # entries: see wire.py
     "unchanged": [{"name", "dtype", "shape", "codec": "raw", "digest"}]}  # delta: kept, not sent

Lifetimes (the sender owns every segment):
1. the sender allocates and fills all buckets, then hands the payload over (HTTP body, queue, ...);
2. the receiver maps the buckets, verifies every digest, and returns tensors that are views of the
   mapped buckets (no copy); the engine copies them into its own weights;
3. the receiver acknowledges (the HTTP response of ``/update_weights_from_tensor``, a queue
   message); only then does the sender call ``SentTransfer.acknowledge()`` (after success: the delta
   tracker moves to this version) or ``close()`` (after a refusal), which unlinks the shared-memory
   segments / drops the CUDA buckets. The sender must not write to a bucket after step 1.
A mapping the receiver still holds stays valid after the unlink (POSIX), and the memory is returned
when the last mapping goes. With a ``ShmPool`` the segments are not unlinked at step 3 but handed to
the next transfer (fresh pages cost more to fill than the copy); the receiver must then be done
with the returned views when it acknowledges, and the pool's ``close()`` unlinks everything.
If the sender dies before closing, Python's resource tracker unlinks its segments at exit;
``close`` also runs when the ``SentTransfer`` is garbage-collected.
Segment names are ``k3xfer-<pid>-<random>-<bucket>``; the receiver maps only names of that form,
from ``/dev/shm`` (Linux).

CUDA IPC: buckets are CUDA uint8 tensors shared through ``torch.multiprocessing.reductions.reduce_tensor``
(its arguments written as JSON, never pickled: a payload is data, not code). CUDA IPC does not work
within one process; the receiver must be another process on the same host. The default digest is
``sum64``, computed on the GPU.

Memory: the buckets hold one wire copy of what is sent (MXFP4 bytes for quantised experts, changed
tensors only for a delta); the sender holds nothing else but one expert's MXFP4 codes at a time.
"""

from __future__ import annotations

import base64
import os
import re
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from collections.abc import Mapping

import torch

from k3core.transfer.delta import DeltaTracker
from k3core.transfer.digest import check_algo, default_algo, tensor_digest
from k3core.transfer.wire import (DEFAULT_BUCKET_BYTES, FORMAT, ROUTED_EXPERT_SUFFIXES, TransferError, TransferReport,
                                  align_up, bucket_digest, content_sha256, dtype_name, item_digest, iter_wire)

__all__ = ["SHM_PREFIX", "SHM_DIR", "SEGMENT_NAME", "SentTransfer", "ShmPool", "send_shm", "send_cuda_ipc",
           "live_segments", "create_segment", "check_shm_dir", "release_segments", "map_segment", "keep_mappings",
           "forget_mappings"]

SHM_PREFIX = "k3xfer-"
SHM_DIR = "/dev/shm"
SEGMENT_NAME = re.compile(rf"^{re.escape(SHM_PREFIX)}[0-9A-Za-z-]{{1,200}}$")  # the only names a receiver maps


def live_segments(prefix: str = SHM_PREFIX) -> list[str]:
    """Names of this transport's segments present in /dev/shm (for leak checks)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def create_segment(name: str, nbytes: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    """A new segment ``name`` of ``nbytes`` (at least 1), and this process's mapping of it."""
    seg = shared_memory.SharedMemory(name=name, create=True, size=max(nbytes, 1))
    seg.close()
    try:
        # our own MAP_SHARED mapping, owned by a torch storage: the SharedMemory object's buffer
        # cannot be pinned by torch, so it is closed at once and kept only to unlink by name
        buf = torch.from_file(os.path.join(SHM_DIR, name), shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    except BaseException:
        seg.unlink()
        raise
    return seg, buf


def _unlink(handles: list) -> None:
    for seg in handles:
        try:
            seg.unlink()  # also unregisters it from this process's resource tracker
        except FileNotFoundError:
            pass
    handles.clear()


def check_shm_dir() -> None:
    """Refuse (``OSError``) a host without POSIX shared memory under ``SHM_DIR``."""
    if not os.path.isdir(SHM_DIR):
        raise OSError(f"{SHM_DIR} not found: the shared-memory transport needs Linux POSIX shared memory")


class ShmPool:
    """Shared-memory segments kept across transfers (``send_shm(..., pool=pool)``).

    Fresh shared memory is slow to fill: the kernel allocates and zeroes every page on first touch,
    which here costs several times the copy itself. A pool keeps each segment after the transfer that
    used it is acknowledged (or closed) and hands it to the next transfer, so steady-state transfers
    write into pages that already exist. The price is standing memory: the pool holds the largest
    transfer's wire bytes in /dev/shm until ``close()`` (or garbage collection, or process exit via
    the resource tracker) unlinks every segment. Contract for the receiver: a reused segment is
    overwritten by the next transfer, so the tensors ``receive`` returned must not be used after the
    ack (``load_payload`` copies them into the engine before returning; ``receive(copy=True)`` keeps
    its own copies). New segments are at least ``segment_bytes`` long."""

    def __init__(self, segment_bytes: int = DEFAULT_BUCKET_BYTES):
        check_shm_dir()
        self.segment_bytes = segment_bytes
        self.tag = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._handles: list[shared_memory.SharedMemory] = []
        self._free: list[tuple[shared_memory.SharedMemory, torch.Tensor]] = []
        self._finalizer = weakref.finalize(self, ShmPool._close, self._handles, self._free)

    @staticmethod
    def _close(handles: list, free: list) -> None:
        free.clear()
        _unlink(handles)

    @property
    def segment_names(self) -> list[str]:
        return [h.name for h in self._handles]

    def take(self, nbytes: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
        if not self._finalizer.alive:
            raise RuntimeError("this ShmPool is closed")
        fits = [i for i, (_, b) in enumerate(self._free) if b.numel() >= nbytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i][1].numel()))
        seg, buf = create_segment(f"{self.tag}-{len(self._handles)}", max(nbytes, self.segment_bytes))
        self._handles.append(seg)
        return seg, buf

    def give(self, pairs: list) -> None:
        if self._finalizer.alive:
            self._free.extend(pairs)

    def close(self) -> None:
        """Unlink every segment. Idempotent; transfers still open must not be used afterwards."""
        self._finalizer()

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def release_segments(pool: ShmPool | None, handles: list, buffers: list[torch.Tensor]) -> None:
    """The sender is done with these segments: back to ``pool``, or unlinked without one."""
    if pool is not None:
        pool.give(list(zip(handles, buffers)))
        handles.clear()
    buffers.clear()
    _unlink(handles)


class _ShmBuckets:
    """POSIX shared-memory segments for one transfer (fresh ones, or borrowed from a pool), each
    mapped once here as a uint8 tensor."""

    transport = "shm"

    def __init__(self, pool: ShmPool | None = None):
        check_shm_dir()
        self.pool = pool
        self.tag = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.handles: list[shared_memory.SharedMemory] = []
        self.buffers: list[torch.Tensor] = []

    def alloc(self, nbytes: int) -> tuple[dict, torch.Tensor]:
        if self.pool is not None:
            seg, buf = self.pool.take(nbytes)
        else:
            seg, buf = create_segment(f"{self.tag}-{len(self.handles)}", nbytes)
        self.handles.append(seg)
        self.buffers.append(buf)
        return {"shm": seg.name}, buf

    def finish(self, descriptors: list[dict]) -> None:
        pass

    release = staticmethod(release_segments)


# ------------------------------------------------------------------ the receiving end's mappings
# Mappings of pooled segments (a sender's ShmPool refills the same segments every transfer), kept
# between transfers so steady-state receives do not fault every page in again: name -> (identity of
# the file, its mapping). Dropped for segments a payload no longer names, or by forget_mappings().
_POOLED: dict[str, tuple[tuple[int, int, int], torch.Tensor]] = {}
_POOLED_LOCK = threading.Lock()  # a server may receive from several threads


def forget_mappings() -> None:
    """Drop the cached mappings of pooled segments (they pin the segments' memory until dropped)."""
    with _POOLED_LOCK:
        _POOLED.clear()


def keep_mappings(names: set) -> None:
    """Drop the cached mappings of pooled segments not in ``names`` (the sender no longer uses them)."""
    with _POOLED_LOCK:
        for name in set(_POOLED) - names:
            del _POOLED[name]


def map_segment(name, nbytes: int, pooled: bool) -> torch.Tensor:
    """The receiver's read-only view of the sender's segment ``name`` (at least ``nbytes`` long), as a
    uint8 tensor; ``pooled``: keep the mapping for the next transfer that names the same file.
    Refuses (``TransferError``) a name not of the ``k3xfer-*`` form, a missing or short segment."""
    if not (isinstance(name, str) and SEGMENT_NAME.match(name)):
        raise TransferError(f"malformed payload: shared-memory name {name!r} is not a k3xfer-* segment name")
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
    if buf.numel() < nbytes:
        raise TransferError(f"shared-memory segment {name} has {buf.numel()} bytes, the payload declares {nbytes}")
    return buf


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


class _CudaBuckets:
    """CUDA uint8 buckets, shared by IPC handle once written."""

    transport = "cuda_ipc"

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None
        self.handles: list = []  # CUDA buckets have no names: dropping the tensors releases them
        self.buffers: list[torch.Tensor] = []

    def alloc(self, nbytes: int) -> tuple[dict, torch.Tensor]:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self.buffers.append(buf)
        return {}, buf

    def finish(self, descriptors: list[dict]) -> None:
        """Share each bucket. Called after every write: the IPC event is recorded at share time,
        and a synchronize before it makes the bytes visible to a receiver whatever its stream."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        torch.cuda.synchronize(self.device)
        for desc, buf in zip(descriptors, self.buffers):
            fn, args = reduce_tensor(buf)
            if fn is not rebuild_cuda_tensor:
                raise RuntimeError(f"reduce_tensor gave {fn}, expected rebuild_cuda_tensor")
            (_, size, stride, t_off, storage_cls, dtype, dev, handle, s_bytes, s_off, _, rc_handle, rc_off,
             ev_handle, ev_sync) = args
            if storage_cls is not torch.storage.TypedStorage or dtype != torch.uint8 or tuple(stride) != (1,):
                raise RuntimeError(f"unexpected CUDA IPC share of a bucket: {storage_cls}, {dtype}, stride {stride}")
            desc["ipc"] = {"device": int(dev), "numel": int(size[0]), "tensor_offset": int(t_off),
                           "handle": _b64(handle), "storage_size_bytes": int(s_bytes),
                           "storage_offset_bytes": int(s_off), "ref_counter_handle": _b64(rc_handle),
                           "ref_counter_offset": int(rc_off), "event_handle": _b64(ev_handle),
                           "event_sync_required": bool(ev_sync)}

    @staticmethod
    def release(pool, handles: list, buffers: list[torch.Tensor]) -> None:
        buffers.clear()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free blocks whose receivers have let go


class SentTransfer:
    """The sender's handle on one transfer: ``payload`` to hand over, ``report`` of the send, and the
    buckets, kept until ``acknowledge()`` or ``close()`` (see the module docstring)."""

    def __init__(self, payload: dict, report: TransferReport, buckets, tracker: DeltaTracker | None,
                 digests: dict[str, str]):
        self.payload, self.report = payload, report
        self._tracker, self._digests = tracker, digests
        self._handles, self._buffers = buckets.handles, buckets.buffers
        self._finalizer = weakref.finalize(self, buckets.release, buckets.pool, self._handles, self._buffers)

    @property
    def segment_names(self) -> list[str]:
        """Shared-memory segment names (empty for CUDA IPC or once closed)."""
        return [h.name for h in self._handles]

    def acknowledge(self) -> None:
        """The receiver loaded this version: move the delta tracker to it, then release the buckets."""
        if self._tracker is not None:
            self._tracker.commit(self.report.weight_version, self._digests, self.report.hash)
        self.close()

    def close(self) -> None:
        """Release the buckets (unlink the segments). Idempotent."""
        self._finalizer()

    def __enter__(self) -> SentTransfer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _aligned_upper_bound(named_tensors: Mapping[str, torch.Tensor], quantize_experts: bool) -> int:
    total = 0
    for name, t in named_tensors.items():
        n = t.numel()
        if quantize_experts and name.endswith(ROUTED_EXPERT_SUFFIXES):
            total += align_up(n // 2) + align_up(n // 32)
        else:
            total += align_up(n * t.element_size())
    return total


def _part_digests(item, algo: str) -> list[str]:
    return [tensor_digest(p, algo) for p in item.parts()]


def _write(buf: torch.Tensor, offset: int, t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    if n:
        buf[offset: offset + n].view(t.dtype).view(t.shape).copy_(t)
    return n


@torch.no_grad()
def _send(buckets, named_tensors: Mapping[str, torch.Tensor], version: int, bucket_bytes: int, quantize_experts: bool,
          w4a8: bool, algo: str, tracker: DeltaTracker | None) -> SentTransfer:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    check_algo(algo)
    t0 = time.perf_counter()
    base_version, base = tracker.base(algo) if tracker is not None else (None, {})
    remaining = _aligned_upper_bound(named_tensors, quantize_experts)
    descs: list[dict] = []
    entries: list[list[dict]] = []
    used: list[int] = []
    unchanged: list[dict] = []
    written: list[tuple] = []  # (item, its entry or None, its part digests or their future)
    cap = 0
    # Without a delta base nothing waits for a digest: each item is hashed from its bucket copy (on the
    # bucket's device: no extra device-to-host copy for CUDA sources) in a second thread, while this
    # one writes the next (hashing and copy_ release the GIL). A delta must hash the source first.
    hasher = ThreadPoolExecutor(1, thread_name_prefix="k3-transfer-digest") if not base else None
    try:
        for item in iter_wire(named_tensors, quantize_experts, w4a8):
            need = sum(align_up(p.numel() * p.element_size()) for p in item.parts())
            if hasher is None:
                part_digests = _part_digests(item, algo)
                d = item_digest(part_digests)
                # only raw items can stay behind: the receiver checks its own copy's digest, and it
                # holds an MXFP4-codec item dequantised, not as the codes the digest covers
                if item.codec == "raw" and base.get(item.name) == d:
                    unchanged.append({"name": item.name, "dtype": dtype_name(item.dtype), "shape": list(item.shape),
                                      "codec": "raw", "digest": d})
                    written.append((item, None, part_digests))
                    remaining -= need
                    continue
            if not descs or used[-1] + need > cap:
                desc, buf = buckets.alloc(max(min(bucket_bytes, remaining), need))
                cap = min(buf.numel(), max(bucket_bytes, need))  # a pooled segment may be larger
                descs.append(desc)
                entries.append([])
                used.append(0)
            buf = buckets.buffers[-1]
            off = used[-1]
            entry = {"name": item.name, "dtype": dtype_name(item.dtype), "shape": list(item.shape),
                     "offset": off, "nbytes": _write(buf, off, item.data)}
            off = align_up(off + entry["nbytes"])
            if item.codec == "mxfp4":
                n = _write(buf, off, item.scale)
                entry["codec"] = "mxfp4"
                entry["scale"] = {"offset": off, "nbytes": n}
                off = align_up(off + n)
            entries[-1].append(entry)
            if hasher is not None:
                views = [buf[entry["offset"]: entry["offset"] + entry["nbytes"]]]
                if item.codec == "mxfp4":
                    views.append(buf[entry["scale"]["offset"]: entry["scale"]["offset"] + entry["scale"]["nbytes"]])
                part_digests = hasher.submit(lambda vs: [tensor_digest(v, algo) for v in vs], views)
            written.append((item, entry, part_digests))
            used[-1] = off
            remaining -= need
        buckets.finish(descs)
        digests: dict[str, str] = {}
        rows = []
        total_bytes = sent_bytes = 0
        for item, entry, part_digests in written:
            if hasher is not None:
                part_digests = part_digests.result()
            d = item_digest(part_digests)
            digests[item.name] = d
            rows.append((item.name, dtype_name(item.dtype), list(item.shape), item.codec, d))
            total_bytes += item.nbytes()
            if entry is not None:
                entry["digest"] = part_digests[0]
                if item.codec == "mxfp4":
                    entry["scale"]["digest"] = part_digests[1]
                sent_bytes += item.nbytes()
    except BaseException:
        buckets.release(buckets.pool, buckets.handles, buckets.buffers)
        raise
    finally:
        if hasher is not None:
            hasher.shutdown(cancel_futures=True)
    payload_buckets = []
    for desc, ents in zip(descs, entries):
        end = max((e["scale"]["offset"] + e["scale"]["nbytes"]) if "scale" in e else (e["offset"] + e["nbytes"])
                  for e in ents)
        payload_buckets.append(desc | {"nbytes": end, "digest": bucket_digest(ents), "tensors": ents})
    content = content_sha256(rows, algo)
    payload = {"format": FORMAT, "transport": buckets.transport, "weight_version": int(version),
               "base_version": base_version if unchanged else None, "hash": algo, "content_sha256": content,
               "num_tensors": len(rows), "buckets": payload_buckets, "unchanged": unchanged,
               "pooled": buckets.pool is not None}
    report = TransferReport(buckets.transport, int(version), algo, content, len(rows), len(rows) - len(unchanged),
                            total_bytes, sent_bytes, time.perf_counter() - t0, len(descs),
                            base_version if unchanged else None)
    return SentTransfer(payload, report, buckets, tracker, digests)


def send_shm(named_tensors: Mapping[str, torch.Tensor], version: int, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             quantize_experts: bool = False, w4a8: bool = True, algo: str | None = None,
             tracker: DeltaTracker | None = None, pool: ShmPool | None = None) -> SentTransfer:
    """Write ``named_tensors`` (native trainer state, CPU or CUDA) into POSIX shared-memory buckets.
    ``tracker``: send only tensors whose digest changed since the tracker's acknowledged version.
    ``pool``: take the buckets from (and give them back to) a ``ShmPool`` instead of creating fresh
    segments and unlinking them after the ack."""
    return _send(_ShmBuckets(pool), named_tensors, version, bucket_bytes, quantize_experts, w4a8,
                 algo or default_algo("cpu"), tracker)


def send_cuda_ipc(named_tensors: Mapping[str, torch.Tensor], version: int, *, device: str | torch.device | None = None,
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, quantize_experts: bool = False, w4a8: bool = True,
                  algo: str | None = None, tracker: DeltaTracker | None = None) -> SentTransfer:
    """Write ``named_tensors`` into CUDA buckets on ``device`` (default: the current CUDA device) and
    share them by CUDA IPC handle. The receiver must be another process on this host."""
    if not torch.cuda.is_available():
        raise RuntimeError("send_cuda_ipc needs CUDA; use send_shm on CPU")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _send(_CudaBuckets(dev), named_tensors, version, bucket_bytes, quantize_experts, w4a8,
                 algo or default_algo(dev), tracker)
