"""The host AdamW kernel (host_adamw.c): built on first use with the system C compiler, called
through ctypes from a few threads.

Owns: compiling and caching the shared object, and splitting one chunk's update into per-thread
runs. Does not own: the optimizer's state or its chunk streaming (``streamed_adam``), or the noise
table and offsets (``stochastic_rounding``).

Build: ``cc -O3 -march=native -ffp-contract=off -fno-math-errno -shared``. The object is cached
under ``$K3RL_KERNEL_CACHE`` (default ``~/.cache/k3rl/kernels``), named by a hash of the source,
the flags, the compiler's version and this CPU's feature flags, so an object built for one machine
is never loaded on another, and published by rename (a crash mid-build leaves no half-written
object under the final name). ``-march=native`` is why the key holds the CPU flags; without
``-fno-math-errno`` sqrtf does not vectorise (it changes errno only, never a value).

No compiler: ``available()`` says why and the optimizer keeps its torch path (``host_kernel="auto"``)
or refuses with that reason (``host_kernel="c"``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("host_adamw.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c11"]
# A run shorter than this is not split across threads: the call and the pool hand-off cost more.
MIN_RUN = 1 << 16


class _Coef(ctypes.Structure):
    _fields_ = [
        ("grad_scale", ctypes.c_float),
        ("decay", ctypes.c_float),
        ("lerp_weight", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("sq_coef", ctypes.c_float),
        ("bc2_sqrt", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("neg_step_size", ctypes.c_float),
    ]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why_not: str | None = None
_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, threads): a forked child makes its own


def _pool(threads: int) -> ThreadPoolExecutor:
    key = (os.getpid(), threads)
    with _lock:
        if key not in _pools:
            _pools[key] = ThreadPoolExecutor(threads, thread_name_prefix="k3-host-adamw")
        return _pools[key]


def _cache_dir() -> Path:
    return Path(os.environ.get("K3RL_KERNEL_CACHE") or Path.home() / ".cache" / "k3rl" / "kernels")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"host_adamw-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be (``why_not()`` says why)."""
    global _lib, _why_not
    with _lock:
        if _lib is not None or _why_not is not None:
            return _lib
        cc = _compiler()
        if cc is None:
            _why_not = "no C compiler found (install gcc, or set CC)"
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))  # named by the source's hash: never a stale build
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why_not = f"the host AdamW kernel could not be built: {e}"
            return None
        fn = lib.k3_adamw_bf16_moments
        fn.restype = None
        fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(_Coef),
                       ctypes.c_void_p, ctypes.c_void_p]
        _lib = lib
        return _lib


def available() -> bool:
    return load() is not None


def why_not() -> str | None:
    load()
    return _why_not


def coefficients(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                 grad_scale: float | None) -> _Coef:
    """The per-step scalars, computed in double and narrowed to float as torch's fused kernel does."""
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    return _Coef(
        grad_scale=1.0 if grad_scale is None else grad_scale,
        decay=1.0 - lr * weight_decay,
        lerp_weight=1.0 - beta1,
        beta2=beta2,
        sq_coef=1.0 - beta2,
        bc2_sqrt=bias_correction2**0.5,
        eps=eps,
        neg_step_size=-(lr / bias_correction1),
    )


class HostUpdater:
    """Runs the kernel over (master, moments, grad, weight-out) runs with `threads` threads (a pool
    per process and thread count, shared by every optimizer).

    A run is given as tensors (flat, contiguous views of one parameter's state and of the stages)
    plus the noise slices' start positions; runs longer than MIN_RUN are cut into pieces, one per
    thread, and every piece's noise start moves with it, so the result does not depend on the
    thread count.
    """

    def __init__(self, threads: int | None = None):
        lib = load()
        if lib is None:
            raise RuntimeError(why_not())
        self._fn = lib.k3_adamw_bf16_moments
        self.threads = max(1, threads or torch.get_num_threads())

    def _call(self, a: int, b: int, run) -> None:
        master, m, v, g, w, coef, noise, pos_m, pos_v = run
        gsz, wsz = g.element_size(), w.element_size()
        if noise is None:
            nm = nv = None
        else:
            base = noise.data_ptr()
            nm, nv = base + 4 * (pos_m + a), base + 4 * (pos_v + a)
        self._fn(b - a, master.data_ptr() + 4 * a, m.data_ptr() + 2 * a, v.data_ptr() + 2 * a,
                 g.data_ptr() + gsz * a, int(g.dtype == torch.float32), w.data_ptr() + wsz * a,
                 int(w.dtype == torch.float32), ctypes.byref(coef), nm, nv)

    def run(self, runs: list[tuple]) -> None:
        """runs: (master fp32 [n], exp_avg bf16 [n], exp_avg_sq bf16 [n], grad [n] bf16|fp32,
        weight out [n] bf16|fp32, coefficients, noise table int32 or None, pos_m, pos_v); each
        noise slice [pos, pos + n) must lie inside the table (the caller cuts runs where it wraps)."""
        for master, m, v, g, w, *_ in runs:
            n = master.numel()
            if not (m.numel() == v.numel() == g.numel() == w.numel() == n):
                raise ValueError("host AdamW run: tensors of different lengths")
            if master.dtype != torch.float32 or m.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
                raise ValueError("host AdamW run: master must be fp32 and moments bf16")
            if g.dtype not in (torch.bfloat16, torch.float32) or w.dtype not in (torch.bfloat16, torch.float32):
                raise ValueError("host AdamW run: gradients and weights must be bf16 or fp32")
            if not all(t.is_contiguous() and t.device.type == "cpu" for t in (master, m, v, g, w)):
                raise ValueError("host AdamW run: tensors must be contiguous host tensors")
        pieces = []
        for run in runs:
            n = run[0].numel()
            step = max(MIN_RUN, -(-n // self.threads))
            pieces += [(a, min(a + step, n), run) for a in range(0, n, step)]
        if self.threads == 1 or len(pieces) == 1:
            self._call_all(pieces)
            return
        # one task per thread, each a contiguous share of the pieces by element count: a pool
        # hand-off per piece costs tens of microseconds, as much as a piece's work on a fast host
        total = sum(b - a for a, b, _ in pieces)
        shares, share, filled = [], [], 0
        for piece in pieces:
            share.append(piece)
            filled += piece[1] - piece[0]
            if filled * self.threads >= total * (len(shares) + 1):
                shares.append(share)
                share = []
        if share:
            shares.append(share)
        pool = _pool(self.threads)  # shared by every optimizer of this process with this thread count
        for f in [pool.submit(self._call_all, share) for share in shares]:
            f.result()

    def _call_all(self, pieces) -> None:
        for piece in pieces:
            self._call(*piece)
