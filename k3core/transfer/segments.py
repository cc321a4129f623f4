"""POSIX shared-memory segments of the streamed transfer (``stream.py``), for both of its ends.

Owns: the segments' names (``k3xfer-<pid>-<random>-<k>``; the receiver maps only names of that form,
from ``/dev/shm``, Linux), creating one with the sender's writable mapping (``create_segment``),
unlinking them (``unlink_segments``), the receiver's read-only mapping (``map_segment``) and listing
the live ones (``live_segments``, for leak checks). Does not own: what travels in them or when a
segment may be refilled (``stream.py``).

Lifetimes: the sender creates the segments and is the only one to unlink them. A mapping the
receiver still holds stays valid after the unlink (POSIX); the memory goes back when the last
mapping goes. A sender that dies without unlinking leaves that to Python's resource tracker, which
unlinks every segment its process registered when the process is gone.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from multiprocessing import shared_memory

import torch

from k3core.transfer.wire import TransferError

__all__ = ["SHM_PREFIX", "SHM_DIR", "SEGMENT_NAME", "live_segments", "check_shm_dir", "create_segment",
           "unlink_segments", "map_segment"]

SHM_PREFIX = "k3xfer-"
SHM_DIR = "/dev/shm"
SEGMENT_NAME = re.compile(rf"^{re.escape(SHM_PREFIX)}[0-9A-Za-z-]{{1,200}}$")  # the only names a receiver maps


def live_segments(prefix: str = SHM_PREFIX) -> list[str]:
    """Names of this transport's segments present in /dev/shm (for leak checks)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def check_shm_dir() -> None:
    """Refuse (``OSError``) a host without POSIX shared memory under ``SHM_DIR``."""
    if not os.path.isdir(SHM_DIR):
        raise OSError(f"{SHM_DIR} not found: the shared-memory transport needs Linux POSIX shared memory")


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


def unlink_segments(handles: list) -> None:
    """Unlink every segment of ``handles`` (and empty the list); an already-unlinked one is skipped."""
    for seg in handles:
        try:
            seg.unlink()  # also unregisters it from this process's resource tracker
        except FileNotFoundError:
            pass
    handles.clear()


def map_segment(name, nbytes: int) -> torch.Tensor:
    """The receiver's read-only view of the sender's segment ``name`` (at least ``nbytes`` long), as a
    uint8 tensor. Refuses (``TransferError``) a name not of the ``k3xfer-*`` form, a missing or short
    segment, and anything at that name that is not a regular file of ``SHM_DIR``'s own filesystem (a
    symlink or a bind-mounted file would let a payload make the receiver read any file it can open,
    and learn its bytes from the refusal). The file checked is the file mapped: it is opened once,
    without following links, and mapped through that descriptor."""
    if not (isinstance(name, str) and SEGMENT_NAME.match(name)):
        raise TransferError(f"malformed payload: shared-memory name {name!r} is not a k3xfer-* segment name")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TransferError(f"shared-memory segment {name} is a symbolic link: refused") from None
        raise TransferError(f"shared-memory segment {name} is missing (did the sender close the transfer before "
                            f"the receiver loaded it?): {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_dev != os.stat(SHM_DIR).st_dev:
            raise TransferError(f"shared-memory segment {name} is not a shared-memory file of {SHM_DIR}: refused")
        # MAP_PRIVATE, opened read-only: the receiver can never write into the sender's bucket
        # (a write would only diverge its own copy, which the next digest check then refuses)
        buf = torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=max(st.st_size, 1), dtype=torch.uint8)
    except (OSError, RuntimeError) as e:
        raise TransferError(f"shared-memory segment {name} could not be mapped: {e}") from None
    finally:
        os.close(fd)
    if buf.numel() < nbytes:
        raise TransferError(f"shared-memory segment {name} has {buf.numel()} bytes, the payload declares {nbytes}")
    return buf
