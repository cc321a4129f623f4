"""Which device a run computes on, and how much memory each stage of it took.

Owns: resolving the ``--device`` setting (``cpu``, ``cuda``, ``auto``) to a ``torch.device``, refusing
``cuda`` where torch sees no GPU; the decode mode a rollout engine uses on that device; and
``MemoryProbe``, which measures one stage's peak device memory and peak host RSS; ``to_device``, the
host-to-device copy that does not wait for the GPU. Does not own: what
runs where (a run resolves its device, dtype and decode mode once, ``tasks.common.Run.of``, and its
stages pass them on to the k3core functions they call), the predicted figures
(``k3core.plan.device_ledger``).

Peaks, per stage:
- device: ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats`` at the
  stage's start (bytes held by tensors through the caching allocator; the allocator's reserve above
  that is not counted). ``device_bytes_after`` is ``memory_allocated`` at the stage's end: what the
  stage left resident (weights of the live trainer and engine; not the engine's decode state nor the
  trainer's activations, which the stages release). On the CPU both are 0: device memory is host RSS.
- host: the process's resident-set high-water mark. On Linux the kernel keeps it (``VmHWM`` in
  ``/proc/self/status``) and resets it on request (writing ``5`` to ``/proc/self/clear_refs``), so the
  figure is the exact peak of the stage: ``host_rss_method`` "vmhwm". Where that reset is refused,
  a thread samples the RSS every 20 ms (psutil) and the figure is the largest sample ("sampled":
  a peak shorter than the period can be missed). The RSS is the process's: a stage running beside
  another (the rollout sampled ahead during the train step) shares its peak with it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from k3core.settings import DECODE_MODES, DEVICES, DTYPES, RLSettings

__all__ = ["DEVICES", "DTYPES", "DeviceUnavailable", "MemoryProbe", "StagePeak", "compute_dtype", "decode_mode",
           "resolve_device", "run_device", "run_dtype", "to_device", "torch_dtype"]


class DeviceUnavailable(ValueError):
    """``--device cuda`` asked for on a machine where torch sees no CUDA device (bad input: exit 2)."""


def resolve_device(spec: str) -> torch.device:
    """``cpu`` -> cpu; ``cuda`` -> cuda (the current CUDA device), refused with ``DeviceUnavailable``
    when ``torch.cuda.is_available()`` is false; ``auto`` -> cuda when available, else cpu."""
    if spec not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {spec!r}")
    if spec == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if spec == "auto":
        return torch.device("cpu")
    build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
    raise DeviceUnavailable(f"--device cuda: torch sees no CUDA device ({build}); run with --device cpu or "
                            "--device auto, or install a CUDA build of torch on a machine with an NVIDIA GPU")


def run_device(s: RLSettings) -> torch.device:
    """The device of a run: ``resolve_device(s.device.type)``, except that ``auto`` stays on the CPU
    where the run asks for paths that only run there (``--task-runner dask|ray``: the workers' engines;
    ``--train-procs`` > 1: the gloo FSDP2 job). ``cuda`` with those is refused by ``RLSettings``."""
    if s.device.type == "auto" and (s.scale_out.task_runner != "local" or s.scale_out.train_procs > 1):
        return torch.device("cpu")
    return resolve_device(s.device.type)


def compute_dtype(device: torch.device | str, spec: str = "auto") -> str:
    """The dtype the trainer's and the engine's weights take on ``device``: ``spec`` when it names one;
    ``auto``: "bfloat16" on CUDA (tensor-core matmuls; fla's shipped kernel configs are for bf16 at
    the model's head shapes, an fp32 call at K = 128 would autotune for minutes, docs/results/gpu_tests.md),
    "float32" on the CPU (CPUs run fp32 matmuls natively, and the small presets' learning curves in
    docs/ were measured in it)."""
    if spec not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {spec!r}")
    if spec != "auto":
        return spec
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def run_dtype(s: RLSettings) -> str:
    """The compute dtype of a run: ``compute_dtype(run_device(s), s.device.dtype)``."""
    return compute_dtype(run_device(s), s.device.dtype)


def torch_dtype(name: str) -> torch.dtype:
    """"float32" / "bfloat16" -> the torch dtype (the tasks pass dtypes by name: Prefect parameters)."""
    if name not in DTYPES[1:]:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES[1:])}, got {name!r}")
    return getattr(torch, name)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, queued without a host sync. torch's ordinary host -> CUDA copy
    (``non_blocking=False``) ends by synchronising the stream, so the host waits until every queued
    kernel has run; a copy from page-locked memory with ``non_blocking=True`` is queued like a kernel
    (torch's pinned-memory cache keeps the staging block until the copy has run, so ``t`` may be
    freed or changed at once). A host ``device``: ``t.to(device)``."""
    device = torch.device(device)
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def decode_mode(device: torch.device | str, requested: str = "auto") -> str:
    """The rollout engine's decode mode on ``device`` (``k3core.rollout.engine``) for the run's
    ``--decode`` setting: the one place "auto" is resolved (engines take a resolved mode). ``auto``:
    on CUDA "static" (fixed-shape decode state, no host sync per step); on the CPU "dynamic" (the
    cache grows with the batch, nothing padded to a bucket), which a CPU runs faster than padded
    static steps. "graph" (CUDA graphs, float and W4A8 experts) is never the automatic choice: it is
    opt-in while its bf16 engine-level GPU test does not hold it to eager decode
    (docs/results/gpu_tests.md has the results). "graph" anywhere but CUDA is refused with a
    ``ValueError`` naming the fix."""
    kind = torch.device(device).type
    if requested == "auto":
        return "static" if kind == "cuda" else "dynamic"
    if requested not in DECODE_MODES:
        raise ValueError(f"--decode must be one of {', '.join(DECODE_MODES)}, got {requested!r}")
    if requested == "graph" and kind != "cuda":
        raise ValueError(f"--decode graph replays CUDA graphs, and this run computes on {kind}: run with --device "
                         "cuda on a GPU machine, or --decode auto")
    return requested


@dataclass(frozen=True)
class StagePeak:
    """One stage's memory: ``device_peak_bytes`` / ``device_bytes_after`` (0 on the CPU) and
    ``host_rss_peak_bytes`` measured as ``host_rss_method`` says ("vmhwm" or "sampled")."""

    device_peak_bytes: int
    device_bytes_after: int
    host_rss_peak_bytes: int
    host_rss_method: str

    def merged(self, other: StagePeak) -> StagePeak:
        """Two calls of one stage (refill rounds): the larger peaks, the later residue."""
        method = self.host_rss_method if self.host_rss_method == other.host_rss_method else "sampled"
        return StagePeak(max(self.device_peak_bytes, other.device_peak_bytes), other.device_bytes_after,
                         max(self.host_rss_peak_bytes, other.host_rss_peak_bytes), method)


def _vmhwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_vmhwm() -> bool:
    """Reset the kernel's RSS high-water mark to the current RSS; False where that is refused."""
    if _vmhwm_bytes() is None:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Context manager around one stage: ``with MemoryProbe(device) as probe: ...`` then ``probe.peak``
    (a ``StagePeak``). Resetting the peaks is process-wide, so probes must not nest."""

    SAMPLE_SECONDS = 0.02

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak: StagePeak | None = None
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled = 0

    def __enter__(self) -> MemoryProbe:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._vmhwm = _reset_vmhwm()
        if not self._vmhwm:
            import psutil

            proc = psutil.Process()
            self._sampled = proc.memory_info().rss

            def sample() -> None:
                while not self._stop.wait(self.SAMPLE_SECONDS):
                    self._sampled = max(self._sampled, proc.memory_info().rss)

            self._sampler = threading.Thread(target=sample, name="k3-rss-sampler", daemon=True)
            self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        dev_peak = dev_after = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            dev_peak = int(torch.cuda.max_memory_allocated(self.device))
            dev_after = int(torch.cuda.memory_allocated(self.device))
        if self._vmhwm:
            host, method = _vmhwm_bytes() or 0, "vmhwm"
        else:
            self._stop.set()
            self._sampler.join()
            import psutil

            host, method = max(self._sampled, psutil.Process().memory_info().rss), "sampled"
        self.peak = StagePeak(dev_peak, dev_after, host, method)
