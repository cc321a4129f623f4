"""Landlock, the kernel's unprivileged access control (Linux 5.13+), as the reward sandbox uses it:
writes confined to a directory (with TCP and scoping rules where the ABI has them), and reads
confined to a list of trees for a program about to run. Imports nothing of the project, so a
verifier can confine the programs it runs without importing the sandbox."""

from __future__ import annotations

import ctypes
import os

__all__ = ["confine_reads", "landlock_abi", "landlock_confine"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_PR_SET_NO_NEW_PRIVS = 38
_SYS_LANDLOCK_CREATE, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT = 444, 445, 446  # one number on every arch
_LL_WRITE_FILE, _LL_TRUNCATE, _LL_REFER = 1 << 1, 1 << 14, 1 << 13
_LL_WRITE_TREE = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make *


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: unavailable)."""
    v = _libc.syscall(_SYS_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(v), 0)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_confine(writable: str, tcp: bool = True) -> list[str]:
    """Refuse writes outside ``writable`` (and /dev/null), with ``tcp`` every TCP bind and connect (ABI 4+),
    signals and abstract Unix sockets beyond this domain (ABI 6+). -> what it enforced."""
    abi = landlock_abi()
    if abi < 1:
        return []
    fs = _LL_WRITE_TREE | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(handled_access_fs=fs, handled_access_net=3 if abi >= 4 and tcp else 0, scoped=3 if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    rfd = _libc.syscall(_SYS_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rfd < 0:
        return []
    try:
        for path, allowed in ((writable, fs), ("/dev/null", _LL_WRITE_FILE | (_LL_TRUNCATE if abi >= 3 else 0))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(allowed_access=allowed, parent_fd=fd)
                if _libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(rfd), ctypes.c_int(1), ctypes.byref(rule),
                                 ctypes.c_uint32(0)) < 0:
                    return []
            finally:
                os.close(fd)
        if os.geteuid() != 0:
            _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if _libc.syscall(_SYS_LANDLOCK_RESTRICT, ctypes.c_int(rfd), ctypes.c_uint32(0)) < 0:
            return []
    finally:
        os.close(rfd)
    out = [f"filesystem writes only under the worker's directory (Landlock ABI {abi})"]
    if abi >= 4 and tcp:
        out.append("TCP bind/connect refused (Landlock)")
    if abi >= 6:
        out.append("signals and abstract Unix sockets beyond the sandbox refused (Landlock)")
    return out


_LL_EXECUTE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 2, 1 << 3
# what a program needs to start an interpreter, besides the interpreter's own tree: the dynamic
# loader's cache and the system's shared libraries, and the devices the standard library opens
_SYSTEM_READS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/etc/ld.so.cache", "/dev/null", "/dev/urandom",
                 "/proc/self")


def confine_reads(readable: list[str]) -> bool:
    """Refuse this process (and what it executes) every read, directory listing and execution outside
    ``readable`` and ``_SYSTEM_READS`` (Landlock, ABI 1+; capabilities do not lift it). Returns False,
    confining nothing, where Landlock is missing. Meant for a process about to ``exec`` a program
    (``subprocess``'s ``preexec_fn``): the reward that judges the program keeps its own reads."""
    abi = landlock_abi()
    if abi < 1:
        return False
    handled = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
    attr = _RulesetAttr(handled_access_fs=handled, handled_access_net=0, scoped=0)
    rfd = _libc.syscall(_SYS_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if rfd < 0:
        return False
    try:
        for path in {*readable, *_SYSTEM_READS}:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine
            try:
                access = handled if os.path.isdir(path) else _LL_EXECUTE | _LL_READ_FILE
                rule = _PathBeneath(allowed_access=access, parent_fd=fd)
                if _libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(rfd), ctypes.c_int(1), ctypes.byref(rule),
                                 ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
            finally:
                os.close(fd)
        _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if _libc.syscall(_SYS_LANDLOCK_RESTRICT, ctypes.c_int(rfd), ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(rfd)
    return True
