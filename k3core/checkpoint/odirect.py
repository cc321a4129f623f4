"""O_DIRECT storage writer for torch.distributed.checkpoint (DCP).

    dcp.save(state_dict, storage_writer=ODirectFileSystemWriter(path))
    dcp.load(state_dict, storage_reader=FileSystemReader(path))      # the stock reader

This module owns one thing: how a rank's DCP data files reach the disk. Planning (which rank
writes which item), the metadata's content and reading stay with DCP.

File format: exactly the stock `FileSystemWriter`'s (torch 2.11 .. 2.13, TORCH_SAVE format).
Each write item is a `torch.save` blob (tensors) or raw bytes (BYTE_IO items) packed back to back;
the metadata records `(relative_path, offset, length)` per item, and the stock
`FileSystemReader` slices the file there. Only the route to the disk differs:

  * Serialisation writes into a fixed pool of page-aligned host buffers (one anonymous mmap) instead
    of a buffered file. A full buffer goes to an I/O thread, which `pwrite`s it through a file
    descriptor opened with `O_DIRECT` while the caller serialises into the next buffer (double
    buffering). Host memory for file data is `num_buffers * buffer_bytes` whatever the checkpoint
    size, and the page cache does not fill up with checkpoint bytes that nobody will read back.
    (Like the stock writer, a tensor that is not on the CPU, or whose storage is larger than the
    tensor, is first copied to a CPU tensor of its own size: that transient copy is bounded by the
    largest item, not by the checkpoint.)
  * Every write starts at a multiple of the buffer size, itself a multiple of the direct-I/O
    alignment (statx STATX_DIOALIGN where the kernel reports it, else 4096). The unaligned tail is
    padded with zeros to the alignment, written with O_DIRECT, and the file is then `ftruncate`d to
    its logical length.
  * Where O_DIRECT is refused (open or write fails with EINVAL, statx says direct I/O is
    unsupported) or is meaningless (tmpfs/ramfs: the page cache is the storage), the same pipeline
    writes through a buffered descriptor, and the writer emits one `ODirectFallbackWarning`.

Hashing: each data file's sha256 is computed from its bytes as its buffers go out (a hash lane
per file, beside the serialisation and the pwrites), and `.metadata`'s from the pickled bytes, so
the checkpoint's manifest needs no read-back of what O_DIRECT kept out of the page cache
(`ODirectFileSystemWriter.digests`).

Durability and publication (a crash at any instant never leaves a `.metadata` naming data that is
missing or half written):

  * data files get per-save names (`__{rank}_{n}.{tag}.distcp`), so a save into a directory that
    already holds a checkpoint never touches the files the old `.metadata` names;
  * each data file is fsynced, then the directory, before a rank reports its results;
  * `finish` writes the metadata to a temporary file, fsyncs it, `os.replace`s it over `.metadata`
    (atomic: a reader sees the old or the new one, never none; the stock writer unlinks the old one
    first) and fsyncs the directory. Only then are data files that no metadata names any more
    (the previous save's, or debris of a killed save) removed.

Not supported (raise ValueError): stream-transform `_extensions` and `SerializationFormat.SAFETENSORS`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import inspect
import math
import mmap
import os
import pickle
import queue
import struct
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = [
    "ODirectFileSystemWriter",
    "ODirectFallbackWarning",
    "WriteStats",
    "AlignedBufferPool",
    "dio_alignment",
    "is_memory_filesystem",
    "one_intra_op_thread",
    "SnapshotArena",
]

# Private to torch but unchanged from 2.4 through 2.13: the reader unpickles `_StorageInfo`
# records from the metadata, so the writer must produce exactly that type.
_StorageInfo = _dcp_fs._StorageInfo
_DATA_SUFFIX = ".distcp"
_METADATA_NAME = ".metadata"
# Recorded in the metadata by torch >= 2.6 writers; absent from older torch.
_DCP_VERSION = getattr(_dcp_fs, "CURRENT_DCP_VERSION", None)

MiB = 1 << 20
_DEFAULT_ALIGN = 4096

# statx(2) / statfs(2) constants (include/uapi/linux/stat.h, magic.h).
_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
_STATX_DIO_MEM_ALIGN_OFFSET = 152  # byte offsets of stx_dio_mem_align / stx_dio_offset_align
_TMPFS_MAGIC = 0x01021994
_RAMFS_MAGIC = 0x858458F6


class ODirectFallbackWarning(RuntimeWarning):
    """O_DIRECT was refused or is meaningless on the target filesystem; writes are buffered."""


# --------------------------------------------------------------------------- filesystem probes


def _libc() -> Any | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def dio_alignment(fd: int) -> int | None:
    """File-offset alignment that O_DIRECT needs for the open file `fd`.

    From statx(STATX_DIOALIGN) (Linux >= 6.1, glibc >= 2.28): the larger of the memory and
    file-offset alignments. Returns None when the kernel or filesystem does not report it, and 0
    when it reports that direct I/O is not supported for this file.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "statx"):
        return None
    buf = ctypes.create_string_buffer(256)  # sizeof(struct statx)
    if libc.statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return None
    (mask,) = struct.unpack_from("I", buf.raw, 0)
    if not mask & _STATX_DIOALIGN:
        return None
    mem_align, offset_align = struct.unpack_from("II", buf.raw, _STATX_DIO_MEM_ALIGN_OFFSET)
    if offset_align == 0:
        return 0
    return max(mem_align, offset_align)


def is_memory_filesystem(path: str | os.PathLike) -> bool:
    """True when `path` lives on tmpfs or ramfs, where file data is page cache by definition."""
    libc = _libc()
    if libc is None or not hasattr(libc, "statfs") or struct.calcsize("P") != 8:
        return False
    buf = ctypes.create_string_buffer(256)  # sizeof(struct statfs) is 120 on 64-bit Linux
    if libc.statfs(os.fsencode(path), buf) != 0:
        return False
    (f_type,) = struct.unpack_from("q", buf.raw, 0)  # __fsword_t f_type comes first
    return (f_type & 0xFFFFFFFF) in (_TMPFS_MAGIC, _RAMFS_MAGIC)


def _fsync_dir(path: str | os.PathLike) -> None:
    """Make the directory entries (created / renamed / removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer (part of the stable ABI since 3.11)."""

    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def _buffer_address(obj) -> int:
    """Address of a C-contiguous buffer's first byte (read-only buffers included, which
    `ctypes.c_char.from_buffer` refuses). Valid while the caller keeps `obj` alive."""
    view = _PyBuffer()
    if _get_buffer(obj, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise BufferError("object does not expose a simple buffer")
    try:
        return view.buf or 0
    finally:
        _release_buffer(ctypes.byref(view))


# Copies at least this large go through ctypes.memmove, which drops the GIL: a 16 MiB copy
# holding the GIL would keep the I/O thread from issuing its next pwrite for ~10 ms.
_GIL_FREE_COPY_BYTES = 64 << 10


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """pwrite all of `data` at `offset` (a regular file may return a short count)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite returned {n}")
        done += n


# --------------------------------------------------------------------------- buffers and I/O


class AlignedBufferPool:
    """`count` buffers of `nbytes` each, carved from one anonymous mmap (so page aligned).

    `acquire()` blocks until a buffer is free: the pool is the writer's whole host-memory budget
    for file data. Accounting: `capacity_bytes` (constant) and `peak_in_use_bytes`.
    """

    def __init__(self, count: int, nbytes: int) -> None:
        if count < 1 or nbytes < 1 or nbytes % mmap.PAGESIZE:
            raise ValueError(f"need count >= 1 and nbytes a multiple of {mmap.PAGESIZE}")
        self.count, self.nbytes = count, nbytes
        self._map = mmap.mmap(-1, count * nbytes)
        self._view = memoryview(self._map)
        self.buffers = [self._view[i * nbytes : (i + 1) * nbytes] for i in range(count)]
        anchor = ctypes.c_char.from_buffer(self._map)
        self._base = ctypes.addressof(anchor)
        del anchor  # drop the export, or mmap.close() would refuse
        self._free = list(range(count))
        self._cond = threading.Condition()
        self._in_use = 0
        self.peak_in_use_bytes = 0

    def address(self, index: int) -> int:
        """Address of buffer `index` (page aligned)."""
        return self._base + index * self.nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.count * self.nbytes

    def acquire(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            self._in_use += 1
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self._in_use * self.nbytes)
            return self._free.pop()

    def release(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self._in_use -= 1
            self._cond.notify()

    def close(self) -> None:
        for b in self.buffers:
            b.release()
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            # a view is still referenced (e.g. from a traceback being propagated); the mapping
            # is unmapped when that reference goes away
            pass


class _IOThreads:
    """The pipeline a full buffer goes through: a hash lane, then an I/O thread that pwrites it and
    hands it back to the pool.

    Hashing: each file is bound to one of `hash_threads` lanes (a FIFO queue served by one thread),
    so its buffers are hashed in the order they were filled, while the serialising thread fills the
    next one and the I/O threads write earlier ones (hashlib releases the GIL on large buffers).
    The file's sha256 is therefore known when its last write returns, without reading it back.

    A failure is recorded on the file it belongs to (`_AlignedFile.error`); the serialising thread
    raises it after the current item or at commit. Buffers are always returned, so nothing
    deadlocks.
    """

    def __init__(self, pool: AlignedBufferPool, threads: int, hash_threads: int = 1) -> None:
        self.pool = pool
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lanes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(max(1, hash_threads))]
        self._next_lane = 0
        self._lane_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"odirect-io-{i}", daemon=True)
            for i in range(threads)
        ]
        self._hashers = [
            threading.Thread(target=self._hash, args=(lane,), name=f"odirect-hash-{i}", daemon=True)
            for i, lane in enumerate(self._lanes)
        ]
        for t in self._threads + self._hashers:
            t.start()

    def lane(self) -> int:
        """A hash lane for a new file (round robin)."""
        with self._lane_lock:
            k = self._next_lane
            self._next_lane = (k + 1) % len(self._lanes)
            return k

    def submit(self, file: _AlignedFile, buf: int, nbytes: int, offset: int, payload: int) -> None:
        """Hash the buffer's first `payload` bytes (the file's own: the padding of an O_DIRECT tail is
        not), then write `nbytes` at `offset`."""
        self._lanes[file.lane].put((file, buf, nbytes, offset, payload))

    def _hash(self, lane: queue.SimpleQueue) -> None:
        while (job := lane.get()) is not None:
            file, buf, nbytes, offset, payload = job
            if file.error is None:
                file.hasher.update(self.pool.buffers[buf][:payload])
            self._jobs.put((file, buf, nbytes, offset))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            file, buf, nbytes, offset = job
            try:
                if file.error is None:
                    file.write_at(self.pool.buffers[buf][:nbytes], offset)
            except BaseException as e:  # noqa: BLE001 - handed to the serialising thread
                file.error = e
            finally:
                self.pool.release(buf)
                file.write_done()

    def close(self) -> None:
        for lane in self._lanes:
            lane.put(None)
        for t in self._hashers:
            t.join()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()


class _AlignedFile:
    """Append-only binary file object for `torch.save`: bytes land in pool buffers, full buffers
    are hashed and written by the I/O threads at buffer-aligned offsets, `commit()` writes the
    padded tail, truncates to the logical length, fsyncs and closes; `sha256()` is then the file's
    digest.

    `tell()` is the logical length so far, which is what DCP records as an item's offset.
    """

    def __init__(self, path: Path, io: _IOThreads, direct: bool, on_fallback) -> None:
        self.path, self._io, self._pool = path, io, io.pool
        self.lane, self.hasher = io.lane(), hashlib.sha256()
        self._on_fallback = on_fallback
        self.error: BaseException | None = None
        self._pos = 0  # logical bytes written
        self._buf: int | None = None  # pool buffer being filled
        self._fill = 0
        self._buf_offset = 0  # file offset of the buffer being filled
        self._pending = 0
        self._cond = threading.Condition()
        self._mode_lock = threading.Lock()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        self.align = 1
        if direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                on_fallback(f"open({path}, O_DIRECT) failed with EINVAL")
        self.opened_direct = self.direct
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        else:
            align = dio_alignment(self.fd)
            if align == 0:
                self._to_buffered("statx reports no direct I/O support")
            elif (align or _DEFAULT_ALIGN) > mmap.PAGESIZE or self._pool.nbytes % (align or 1):
                # pool buffers are only page aligned
                self._to_buffered(f"direct-I/O alignment {align} exceeds the page size")
            else:
                self.align = align or _DEFAULT_ALIGN

    # ---- file-object protocol used by torch.save / DCP
    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """No-op: bytes reach the disk when a buffer fills and at commit()."""

    def write(self, data) -> int:
        src = memoryview(data).cast("B")
        n, done = len(src), 0
        if self.error is not None:
            # Never raise into torch.save: its zip writer would mask the cause with its own
            # "unexpected pos" error. The caller checks `raise_if_failed()` after every item.
            self._pos += n
            return n
        src_address = None
        while done < n:
            if self._buf is None:
                self._buf, self._fill = self._pool.acquire(), 0
            k = min(n - done, self._pool.nbytes - self._fill)
            if k >= _GIL_FREE_COPY_BYTES:
                if src_address is None:
                    src_address = _buffer_address(src)
                ctypes.memmove(self._pool.address(self._buf) + self._fill, src_address + done, k)
            else:
                self._pool.buffers[self._buf][self._fill : self._fill + k] = src[done : done + k]
            self._fill += k
            done += k
            if self._fill == self._pool.nbytes:
                self._submit(self._fill, self._fill)
        self._pos += n
        return n

    # ---- called by the I/O threads
    def write_at(self, data: memoryview, offset: int) -> None:
        try:
            _pwrite_all(self.fd, data, offset)
        except OSError as e:
            # opened_direct, not direct: another I/O thread may have just cleared O_DIRECT after
            # this write had already been refused
            if not (self.opened_direct and e.errno == errno.EINVAL):
                raise
            self._to_buffered(f"pwrite(O_DIRECT) to {self.path} failed with EINVAL")
            _pwrite_all(self.fd, data, offset)

    def write_done(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    # ---- internals
    def _to_buffered(self, reason: str) -> None:
        """Clear O_DIRECT on the open descriptor (Linux allows it through F_SETFL)."""
        with self._mode_lock:
            if not self.direct:
                return
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
        self._on_fallback(reason)

    def _submit(self, nbytes: int, payload: int) -> None:
        with self._cond:
            self._pending += 1
        self._io.submit(self, self._buf, nbytes, self._buf_offset, payload)
        self._buf_offset += nbytes
        self._buf = None

    def _wait_idle(self) -> None:
        with self._cond:
            while self._pending:
                self._cond.wait()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise OSError(f"writing {self.path} failed: {self.error!r}") from self.error

    def commit(self, sync: bool) -> None:
        """Write the tail, wait for every write of this file, truncate, fsync, close."""
        try:
            self.raise_if_failed()
            if self._buf is not None:
                nbytes = self._fill
                if self.direct:
                    # pad to the alignment; the padding is cut off by the ftruncate below
                    nbytes = -(-self._fill // self.align) * self.align
                    self._pool.buffers[self._buf][self._fill : nbytes] = bytes(nbytes - self._fill)
                self._submit(nbytes, self._fill)
            self._wait_idle()
            self.raise_if_failed()
            if self._buf_offset != self._pos:
                os.ftruncate(self.fd, self._pos)
            if sync:
                os.fsync(self.fd)
        finally:
            self.abort()

    def sha256(self) -> str:
        """Hex sha256 of the file's bytes: complete once `commit()` returned."""
        return self.hasher.hexdigest()

    def abort(self) -> None:
        """Give the buffer back, let in-flight writes drain, close the descriptor (idempotent)."""
        if self._buf is not None:
            self._pool.release(self._buf)
            self._buf = None
        self._wait_idle()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# --------------------------------------------------------------------------- the DCP writer


@contextlib.contextmanager
def one_intra_op_thread():
    """torch ops of the calling thread on that thread alone, restored on exit. The writer's copies
    to the host run beside other stages (a rollout, a train step's forward): a thread that runs
    torch ops gets an OpenMP team of its own, whose workers spin after each op and take cores from
    the stages beside it. torch's thread count is per calling thread (OpenMP's nthreads ICV)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclasses.dataclass
class WriteStats:
    """What the last `write_data` call did on this rank (the writer's own accounting)."""

    files: int = 0
    payload_bytes: int = 0  # logical bytes of all data files (what the reader sees)
    direct_files: int = 0  # files that finished with O_DIRECT still on
    buffered_files: int = 0
    pool_bytes: int = 0  # host memory reserved for file data: num_buffers * buffer_bytes
    peak_pool_bytes_in_use: int = 0
    seconds: float = 0.0


def _item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


def _split_into_files(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """The stock writer's bucketing: BYTE_IO items round robin, tensors largest first onto the
    least loaded file."""
    if files == 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(files)]
    loads = [0] * files
    byte_items = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensor_items = sorted(
        (it for it in items if it.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True
    )
    for i, it in enumerate(byte_items):
        buckets[i % files].append(it)
    for it in tensor_items:
        j = loads.index(min(loads))
        buckets[j].append(it)
        loads[j] += _item_nbytes(it)
    return buckets


def _cpu_tensor(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    """The item's tensor on the CPU with minimal storage, as the stock loader produces it
    (torch.save writes the whole storage, so a view of a larger storage is cloned)."""
    tensor = planner.resolve_data(item).detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _private(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` that nothing else holds (its own minimal storage)."""
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def _own_copy(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
    """A private CPU copy of the item's tensor."""
    return _private(planner.resolve_data(item).detach())


class SnapshotArena:
    """Host memory that a freeze copies into, kept from one write to the next. A copy into fresh
    memory pays a page fault per page on first touch and runs several times slower than one into
    touched memory (docs/results/checkpoints_off_critical_path.md), and a write behind freezes once
    per iteration, so the arena keeps the largest freeze so far (at most one trainer state's bytes)
    for the next. One write uses it at a time; a second one meanwhile copies into fresh memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._busy = False

    @property
    def nbytes(self) -> int:
        return len(self._map) if self._map is not None else 0

    def take(self, nbytes: int) -> memoryview | None:
        """``nbytes`` of the arena for one freeze (None while another write holds it)."""
        with self._lock:
            if self._busy:
                return None
            if self.nbytes < nbytes:
                old, self._map = self._map, mmap.mmap(-1, nbytes)
                if old is not None:
                    with contextlib.suppress(BufferError):  # a view still alive: freed with it
                        old.close()
            self._busy = True
            return memoryview(self._map)[:nbytes]

    def give_back(self) -> None:
        with self._lock:
            self._busy = False


def _copies_into(arena: SnapshotArena | None, tensors: dict[Any, torch.Tensor]) -> tuple[dict[Any, torch.Tensor], bool]:
    """CPU copies of ``tensors``, each with a storage of its own size (``torch.save`` writes a whole
    storage), laid out in ``arena`` when it is free (then True: the caller gives it back once the
    copies are written), else in fresh memory."""
    align = 64
    offsets, total = {}, 0
    for k, t in tensors.items():
        offsets[k] = total
        total += -(-t.numel() * t.element_size() // align) * align
    room = arena.take(total) if arena is not None and total else None
    if room is None:
        return {k: _private(t) for k, t in tensors.items()}, False
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer: the arena is writable, the warning is moot
        for k, t in tensors.items():
            n = t.numel() * t.element_size()
            dst = torch.frombuffer(room[offsets[k]:offsets[k] + n], dtype=t.dtype) if n else torch.empty(0, dtype=t.dtype)
            out[k] = dst.view(t.shape).copy_(t)
    return out, True


class _FreezableSource:
    """Where a freezable writer's tensors come from, and ``freeze``.

    Until a freeze, each tensor item is copied from the state dict when a serialising thread reaches
    it; the writer then reads only that copy. ``freeze`` copies every item no thread has reached yet,
    at once, in the caller's thread, and waits for the copies in progress: after it returns nothing
    the write does reads the state dict, so the caller may change it (an optimizer step) while the
    write goes on. Host memory after a freeze: the items not written yet, each freed once written."""

    def __init__(self, arena: SnapshotArena | None = None) -> None:
        self._arena = arena
        self._in_arena = False
        self._cond = threading.Condition()
        self._ready = threading.Event()  # the plan is known (or the write ended): a freeze can answer
        self._planner: SavePlanner | None = None
        self._pending: dict[Any, WriteItem] = {}  # items no thread has reached
        self._claimed: set = set()  # items a freeze is copying
        self._copies: dict[Any, torch.Tensor] = {}  # the freeze's copies, taken by the threads
        self._copying = 0  # threads copying from the state dict right now
        self._ended: bool | None = None  # the data phase: None running, True written, False failed
        self.frozen = False  # a freeze returned: the caller may have changed the state dict since
        self.frozen_bytes = 0  # what the freeze copied: the host memory it added, freed as written

    def start(self, planner: SavePlanner, items: list[WriteItem]) -> None:
        with self._cond:
            self._planner = planner
            self._pending = {it.index: it for it in items if it.type != WriteItemType.BYTE_IO}
        self._ready.set()

    def end(self, ok: bool) -> None:
        """The write's data phase ended: every item written (``ok``), or it failed (a freeze after
        that answers False: the state must stay as it is for whatever writes it next)."""
        with self._cond:
            self._pending.clear()
            self._copies.clear()  # written, or abandoned with the failed write
            self._ended = ok
            self._cond.notify_all()
        if self._in_arena:
            self._in_arena = False
            self._arena.give_back()
        self._ready.set()

    def tensor(self, item: WriteItem) -> torch.Tensor:
        with self._cond:
            while item.index in self._claimed:
                self._cond.wait()
            copy = self._copies.pop(item.index, None)
            if copy is not None:
                return copy
            self._pending.pop(item.index, None)
            self._copying += 1
        try:
            return _own_copy(self._planner, item)
        finally:
            with self._cond:
                self._copying -= 1
                self._cond.notify_all()

    def freeze(self, timeout: float | None = None) -> bool:
        """Copy what the write has not read yet; False when the plan is not known within ``timeout``."""
        if not self._ready.wait(timeout):
            return False
        with self._cond:
            if self.frozen or self._ended:
                self.frozen = True
                return True
            if self._ended is False:
                return False
            claim, self._pending = self._pending, {}
            self._claimed = set(claim)
        copies: dict[Any, torch.Tensor] = {}
        try:
            sources = {index: self._planner.resolve_data(item).detach() for index, item in claim.items()}
            copies, self._in_arena = _copies_into(self._arena, sources)
            self.frozen_bytes = sum(c.numel() * c.element_size() for c in copies.values())
        finally:
            with self._cond:  # on a failure (out of memory) the items not copied go back to the threads
                self._copies.update(copies)
                self._pending.update({i: it for i, it in claim.items() if i not in copies})
                self._claimed = set()
                self._cond.notify_all()
        with self._cond:
            while self._copying:
                self._cond.wait()
            self.frozen = True
        return True


class ODirectFileSystemWriter(FileSystemWriter):
    """Drop-in for `torch.distributed.checkpoint.FileSystemWriter` that writes data files with
    O_DIRECT through a bounded pool of aligned buffers (see the module docstring).

    Args (the stock ones keep their meaning):
        path: checkpoint directory.
        single_file_per_rank: one file per rank (per `thread_count` bucket) instead of per item.
        sync_files: fsync data files, metadata and directory (default True). Without it a crash
            can leave a published checkpoint whose data never reached the disk.
        thread_count: serialising threads per rank (each writes its own file).
        per_thread_copy_ahead, cache_staged_state_dict, overwrite: passed to `FileSystemWriter`
            (per_thread_copy_ahead is accepted for compatibility; items are copied to the host
            one at a time, just before they are serialised).
        buffer_bytes: size of one pool buffer, a multiple of the page size and of the direct-I/O
            alignment; it is also the size of one pwrite.
        num_buffers: pool size, >= 2 (one being filled while another is written); default
            2 * thread_count + 2. Host memory for file data is num_buffers * buffer_bytes.
        io_threads: threads issuing pwrites (more than one keeps several writes in flight).
        hash_threads: threads hashing filled buffers in order (default: thread_count, one per
            file written at a time).
        direct: False writes through the page cache (same pipeline, no warning).
        remove_stale: after publishing, delete `__*_*.distcp` files that the new metadata does not
            name (the previous checkpoint's data, debris of a killed save).
        freezable: every tensor is copied before it is serialised (not only views and device
            tensors), and `freeze()` may be called from another thread while the save runs: it
            copies what the write has not read yet, after which the caller may change the state
            dict (see `_FreezableSource`).
        snapshot_arena: where a freeze copies to (`SnapshotArena`, kept by the caller from one
            write to the next); without one, fresh memory.

    After a save, `last_stats` holds this rank's `WriteStats` and `digests` the sha256 and size of
    every file it wrote (data files; `.metadata` on the coordinator), computed from the bytes as
    they went out: `k3core.checkpoint.manifest.write_manifest(root, known=...)` takes them instead
    of reading the files back.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Any = None,
        serialization_format: Any = None,
        *,
        buffer_bytes: int = 16 * MiB,
        num_buffers: int | None = None,
        io_threads: int = 1,
        hash_threads: int | None = None,
        direct: bool = True,
        remove_stale: bool = True,
        freezable: bool = False,
        snapshot_arena: SnapshotArena | None = None,
    ) -> None:
        if _extensions:
            raise ValueError("ODirectFileSystemWriter does not support stream-transform _extensions")
        if serialization_format is not None and getattr(serialization_format, "value", None) != "torch_save":
            raise ValueError("ODirectFileSystemWriter writes the TORCH_SAVE format only")
        if num_buffers is None:
            num_buffers = 2 * thread_count + 2
        if num_buffers < 2 or io_threads < 1 or thread_count < 1:
            raise ValueError("need num_buffers >= 2, io_threads >= 1, thread_count >= 1")
        if buffer_bytes % _DEFAULT_ALIGN or buffer_bytes % mmap.PAGESIZE:
            raise ValueError(f"buffer_bytes must be a multiple of {max(_DEFAULT_ALIGN, mmap.PAGESIZE)}")
        super().__init__(
            path,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
        )
        self.buffer_bytes = buffer_bytes
        self.num_buffers = num_buffers
        self.io_threads = io_threads
        self.hash_threads = hash_threads or thread_count
        self.direct = direct
        self.remove_stale = remove_stale
        self._source = _FreezableSource(snapshot_arena) if freezable else None
        self.last_stats: WriteStats | None = None
        self.digests: dict[str, tuple[str, int]] = {}
        self._fallback_lock = threading.Lock()
        self._fallback_warned = False
        self._is_coordinator = True

    # ---- setup: remember rank / coordinator whatever the torch version passes
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._is_coordinator = is_coordinator
        params = inspect.signature(super().set_up_storage_writer).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        else:  # older torch: set_up_storage_writer(is_coordinator)
            super().set_up_storage_writer(is_coordinator)
            self.rank = kwargs.get("rank")
            self.use_collectives = kwargs.get("use_collectives", True)

    def _warn_fallback(self, reason: str) -> None:
        with self._fallback_lock:
            if self._fallback_warned:
                return
            self._fallback_warned = True
        warnings.warn(
            f"ODirectFileSystemWriter: {reason}; writing {self.path} through the page cache "
            "(same bounded buffers, no O_DIRECT)",
            ODirectFallbackWarning,
            stacklevel=2,
        )

    def freeze(self, timeout: float | None = None) -> bool:
        """From its return on, the save reads none of the state dict's tensors: the items it has
        not read yet are copied now (host memory: their bytes, freed as they are written). False
        when the save has not planned its items within ``timeout`` (call again). Needs ``freezable``."""
        if self._source is None:
            raise ValueError("freeze() needs ODirectFileSystemWriter(..., freezable=True)")
        return self._source.freeze(timeout)

    @property
    def frozen(self) -> bool:
        """Whether a ``freeze`` returned: the state dict may have changed since."""
        return self._source is not None and self._source.frozen

    @property
    def frozen_bytes(self) -> int:
        """Bytes the freeze copied (the host memory it added until they were written)."""
        return self._source.frozen_bytes if self._source is not None else 0

    # ---- data
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t0 = time.perf_counter()
        directory = Path(self.path)
        prefix = plan.storage_data.prefix
        tag = uuid.uuid4().hex[:12]
        if self.single_file_per_rank:
            groups = _split_into_files(plan.items, self.thread_count)
        else:
            groups = [[item] for item in plan.items]
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i, group in enumerate(groups):
            jobs.put((f"{prefix}{i}.{tag}{_DATA_SUFFIX}", group))

        direct = self.direct
        if direct and is_memory_filesystem(directory):
            self._warn_fallback(f"{directory} is on tmpfs/ramfs, where O_DIRECT gives nothing")
            direct = False

        stats = WriteStats(files=len(groups))
        results: list[WriteResult] = []
        failures: list[BaseException] = []
        lock = threading.Lock()
        pool = AlignedBufferPool(self.num_buffers, self.buffer_bytes)
        io = _IOThreads(pool, self.io_threads, self.hash_threads)
        self.digests = {}
        if self._source is not None:
            self._source.start(planner, plan.items)

        def serialise() -> None:
            with one_intra_op_thread():
                serialise_files()

        def serialise_files() -> None:
            while not failures:
                try:
                    name, group = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    file_results, file_direct, nbytes, digest = self._write_file(
                        directory / name, name, group, planner, io, direct
                    )
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    with lock:
                        failures.append(e)
                    return
                with lock:
                    results.extend(file_results)
                    self.digests[name] = (digest, nbytes)
                    stats.payload_bytes += nbytes
                    stats.direct_files += int(file_direct)
                    stats.buffered_files += int(not file_direct)

        try:
            workers = [threading.Thread(target=serialise) for _ in range(1, self.thread_count)]
            for w in workers:
                w.start()
            serialise()
            for w in workers:
                w.join()
        finally:
            if self._source is not None:
                self._source.end(ok=not failures and sys.exc_info()[0] is None)
            io.close()
            stats.pool_bytes = pool.capacity_bytes
            stats.peak_pool_bytes_in_use = pool.peak_in_use_bytes
            pool.close()
        if failures:
            raise failures[0]
        if self.sync_files:
            _fsync_dir(directory)
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(
        self,
        path: Path,
        name: str,
        items: list[WriteItem],
        planner: SavePlanner,
        io: _IOThreads,
        direct: bool,
    ) -> tuple[list[WriteResult], bool, int, str]:
        """One data file: BYTE_IO items first, then tensors in plan order (the stock CPU order).
        Returns (write results, whether O_DIRECT held, bytes, sha256)."""
        f = _AlignedFile(path, io, direct, self._warn_fallback)
        results = []
        try:
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    continue
                offset = f.tell()
                f.write(planner.resolve_data(item).getbuffer())
                f.raise_if_failed()
                results.append(self._result(item, name, offset, f.tell() - offset))
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                tensor = self._source.tensor(item) if self._source is not None else _cpu_tensor(planner, item)
                offset = f.tell()
                torch.save(tensor, f)
                del tensor
                f.raise_if_failed()
                results.append(self._result(item, name, offset, f.tell() - offset))
            f.commit(self.sync_files)
        except BaseException:
            f.abort()
            raise
        return results, f.direct, f.tell(), f.sha256()

    @staticmethod
    def _result(item: WriteItem, name: str, offset: int, length: int) -> WriteResult:
        return WriteResult(
            index=item.index,
            size_in_bytes=length,
            storage_data=_StorageInfo(name, offset, length),
        )

    # ---- publication
    def _metadata_name(self) -> str:
        rank = getattr(self, "rank", None)
        if not getattr(self, "use_collectives", True) and rank is not None:
            return f"__{rank}{_METADATA_NAME}"
        return _METADATA_NAME

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Publish `.metadata` atomically (temp file, fsync, rename over, fsync the directory),
        then remove data files it does not name."""
        if _DCP_VERSION is not None:
            metadata.version = _DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        directory = Path(self.path)
        final = self._metadata_name()
        tmp = directory / f"{final}.{uuid.uuid4().hex[:12]}.tmp"
        data = pickle.dumps(metadata)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.sync_files:
                    os.fsync(f.fileno())
            os.replace(tmp, directory / final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.digests[final] = (hashlib.sha256(data).hexdigest(), len(data))
        if self.sync_files:
            _fsync_dir(directory)
        if self.remove_stale:
            self._remove_stale(directory, final, metadata)

    def _remove_stale(self, directory: Path, final: str, metadata: Metadata) -> None:
        named = {info.relative_path for info in metadata.storage_data.values()}
        if final == _METADATA_NAME:
            owned = lambda n: n.startswith("__")  # noqa: E731 - every rank's data files
        else:  # rank-local metadata: only this rank's files are ours to judge
            owned = lambda n: n.startswith(f"__{self.rank}_")  # noqa: E731
        removed = False
        for entry in os.scandir(directory):
            n = entry.name
            stale_data = n.endswith(_DATA_SUFFIX) and owned(n) and n not in named
            stale_tmp = n.startswith(f"{final}.") and n.endswith(".tmp")
            if (stale_data or stale_tmp) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed = True
        if removed and self.sync_files:
            _fsync_dir(directory)
