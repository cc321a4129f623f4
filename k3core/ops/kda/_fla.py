"""The flash-linear-attention (fla 0.6.0) dispatch: argument translation only, no copies.

fla imports triton at module load, which is absent on CPU-only machines, so the import is lazy and
guarded; ``require`` turns a failed import into an error that says what to install or which
backend to pick instead. Conventions checked against fla 0.6.0's ``fla/ops/kda/chunk.py`` and
``fused_recurrent.py``: same ``[B, T, H, K]`` layout and log-space per-key g as ours, state
``[N, H, K, V]`` fp32 (``state_v_first=False``), ``cu_seqlens`` int64 on the device with ``B == 1``,
L2 norm ``x / sqrt(sum x^2 + 1e-6)`` in kernel, and the in-kernel "safe" gate
``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``use_gate_in_kernel`` and
``lower_bound`` are set (our ``kda_gate``).

Kernel configs: fla autotunes each Triton kernel on its first call for every new shape (minutes for
a KDA forward+backward). fla 0.6 can read the winners from a directory instead (``FLA_CACHE_MODE``,
``FLA_CONFIG_DIR``; ``fla/ops/utils/cache.py``), and k3rl ships them in ``fla_configs/<fla-core
version>/<GPU name>/`` (made by ``fla_tune.py``). Just before fla is imported, ``_load`` points fla
there when a directory exists for the installed fla-core and this GPU, or one tuned on a GPU whose
configs launch here (``configs_fit``); a variable the user set is left alone. fla reads ``FLA_CACHE_MODE`` once, at import, hence "before".
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

import torch

_MODULE = None
_ERROR: BaseException | None = None

SHIPPED_CONFIGS = Path(__file__).with_name("fla_configs")
# fla's strict mode reads exact keys only, and k3core adds one fallback of its own
# (``_install_head_count_fallback``): an entry whose key differs from the call's only in head or batch
# counts (``B``, ``H``, ``HV``). Those size the launch grid, not a program's tiles, so its config fits
# shared memory exactly as it did when tuned. fla's own "fuzzy" mode is not safe to use: it ignores
# every number, and a config tuned at K = 64 in fp32 failed to fit shared memory at K = 128
# (docs/results/gpu_tests.md). A call with no such entry autotunes, as fla does without configs.
HEAD_COUNT_ARGS = frozenset({"B", "H", "HV"})
SHIPPED_CACHE_MODE = "strict"

INSTALL_HINT = "pip install --no-deps fla-core==0.6.0 flash-linear-attention==0.6.0 (needs triton)"


def gpu_config_name(device: int | None = None) -> str:
    """The CUDA device's name as a directory name (runs of other characters become one ``_``), the
    rule fla uses for its own per-GPU config folders: ``NVIDIA H200`` -> ``NVIDIA_H200``."""
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def gpu_arch(device: int | None = None) -> dict:
    """What decides whether a Triton config tuned on one GPU launches on another: the compute
    capability (the instructions a kernel compiles to) and the shared memory one program may use
    (a config's tiles and stages must fit it). The SM count only changes how fast a config runs."""
    props = torch.cuda.get_device_properties(device)
    return {"capability": f"{props.major}.{props.minor}",
            "smem_per_block_optin": getattr(props, "shared_memory_per_block_optin", None),
            "multi_processor_count": props.multi_processor_count}


def configs_fit(tuned_on: dict | None, here: dict) -> bool:
    """True when configs tuned on a GPU described by ``tuned_on`` (``gpu_arch`` as recorded in a
    MANIFEST) launch on ``here``: same compute capability, and at least as much shared memory per
    program. An unrecorded or unknown figure never fits."""
    if not tuned_on or tuned_on.get("capability") != here.get("capability"):
        return False
    need, have = tuned_on.get("smem_per_block_optin"), here.get("smem_per_block_optin")
    return need is not None and have is not None and have >= need


def _manifest_arch(path: Path) -> dict | None:
    try:
        return json.loads((path / "MANIFEST.json").read_text()).get("versions", {}).get("arch")
    except (OSError, ValueError, AttributeError):
        return None


def shipped_config_dir() -> Path | None:
    """``fla_configs/<fla-core version>/<GPU>/`` for the installed fla-core: this GPU's own directory
    when there is one, else the first (by name) whose MANIFEST records a GPU whose configs fit this
    one (``configs_fit``: an H100 reads the H200's, same sm_90 and shared memory), else None. Configs
    of another fla version may name kernel arguments that no longer exist: never used."""
    if not torch.cuda.is_available():
        return None
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = SHIPPED_CONFIGS / version / gpu_config_name()
    if path.is_dir():
        return path
    root = SHIPPED_CONFIGS / version
    here = gpu_arch()
    for other in sorted(root.iterdir()) if root.is_dir() else []:
        if other.is_dir() and configs_fit(_manifest_arch(other), here):
            return other
    return None


def point_fla_at_shipped_configs() -> dict[str, str]:
    """Set ``FLA_CACHE_MODE`` and ``FLA_CONFIG_DIR`` for the shipped configs, each only where unset;
    returns what was set. Nothing is set once fla's cache module is imported (it has read the mode
    already) or when no directory fits this GPU and fla version."""
    if "fla.ops.utils.cache" in sys.modules:
        return {}
    path = shipped_config_dir()
    if path is None:
        return {}
    wanted = {"FLA_CACHE_MODE": SHIPPED_CACHE_MODE, "FLA_CONFIG_DIR": str(path)}
    set_now = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


def head_count_match(entries: list[list], names: list[str], key: list) -> list | None:
    """The first of ``entries`` (autotune keys, in file order) equal to ``key`` everywhere except at
    positions named in ``HEAD_COUNT_ARGS``; ``names`` names the key's leading positions (the
    autotuner's key arguments present in the call; the tensor dtypes follow, unnamed). None if none."""
    free = {i for i, n in enumerate(names) if n in HEAD_COUNT_ARGS}
    for entry in entries:
        if len(entry) == len(key) and all(a == b for i, (a, b) in enumerate(zip(entry, key)) if i not in free):
            return entry
    return None


def _install_head_count_fallback(config_dir: Path) -> None:
    """After fla's exact lookup finds nothing, try ``head_count_match`` over the kernel's shipped
    entries; the config found is what fla itself would apply for that entry's key."""
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner, read_config_file  # noqa: PLC0415

    if getattr(CachedAutotuner, "_k3rl_head_count_fallback", False):
        return
    original = CachedAutotuner.maybe_load_cached_config
    entries: dict[str, list[list]] = {}

    def shipped(kernel: str) -> list[list]:
        if kernel not in entries:
            path = config_dir / f"{kernel}.json"  # fla's reader: cached, None when missing or unreadable
            data = (read_config_file(path) if path.exists() else None) or {}
            entries[kernel] = [e["autotune_key"] for e in (data.get("autotune_entries") or {}).values()]
        return entries[kernel]

    def maybe_load_cached_config(self, key, nargs, runtime_kwargs):
        original(self, key=key, nargs=nargs, runtime_kwargs=runtime_kwargs)
        if key.autotune_key in self.cache:
            return
        present = {**nargs, **runtime_kwargs}
        names = [n for n in self.keys if n in present and n in self.arg_names]
        found = head_count_match(shipped(self.kernel_name), names, AutotuneKey.normalize_autotune_key(list(key.autotune_key)))
        if found is None:
            return
        other = AutotuneKey(tuple(found))
        original(self, key=other, nargs=nargs, runtime_kwargs=runtime_kwargs)
        if other.autotune_key in self.cache:
            self.cache[key.autotune_key] = self.cache[other.autotune_key]

    CachedAutotuner.maybe_load_cached_config = maybe_load_cached_config
    CachedAutotuner._k3rl_head_count_fallback = True


def _load():
    global _MODULE, _ERROR
    if _MODULE is None and _ERROR is None:
        try:
            point_fla_at_shipped_configs()
            import fla.ops.kda as module  # noqa: PLC0415  (lazy: imports triton)
            config_dir = os.environ.get("FLA_CONFIG_DIR")
            if os.environ.get("FLA_CACHE_MODE") == SHIPPED_CACHE_MODE and config_dir:
                _install_head_count_fallback(Path(config_dir))
            _MODULE = module
        except Exception as e:  # ImportError without triton; other errors from a broken install
            _ERROR = e
    return _MODULE


def available() -> bool:
    """True when ``fla.ops.kda`` imports (triton present)."""
    return _load() is not None


def require(fn: str):
    module = _load()
    if module is None:
        raise RuntimeError(
            f"{fn}: CUDA tensors are dispatched to flash-linear-attention, which failed to import "
            f"({type(_ERROR).__name__}: {_ERROR}). Install it ({INSTALL_HINT}) or pass "
            f"backend='torch' for the (slower) chunked torch path.")
    return module


def _safe_gate(lower_bound) -> bool:
    # fla's M=16 TensorCore path is valid for gates bounded in [lower_bound, 0), lower_bound >= -5
    return lower_bound is not None and -5.0 <= float(lower_bound) < 0.0


def _gate_kwargs(A_log, dt_bias, lower_bound) -> dict:
    if A_log is None:
        return {}
    return dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=float(lower_bound))


def _varlen_kwargs(cu_seqlens, device, cu_seqlens_cpu=None) -> dict:
    """fla's ``cu_seqlens`` (int64 on the device: no copy when the caller passes it so, else one
    host -> device copy, which waits for the GPU queue) and ``cu_seqlens_cpu`` (its host copy: lets
    fla skip a device -> host read)."""
    if cu_seqlens is None:
        return {}
    kw = {"cu_seqlens": cu_seqlens.to(device=device, dtype=torch.long)}
    host = cu_seqlens if cu_seqlens.device.type == "cpu" else cu_seqlens_cpu
    if host is not None:
        kw["cu_seqlens_cpu"] = host.to(torch.long)
    return kw


def _state(initial_state):
    return None if initial_state is None else initial_state.float()  # no-op for fp32 (fla asserts fp32)


def chunk(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
          cu_seqlens=None, cu_seqlens_cpu=None, A_log=None, dt_bias=None, lower_bound=None):
    """``fla.ops.kda.chunk_kda`` with our argument names. With ``A_log``/``dt_bias``, g is the raw
    gate input f; with only ``lower_bound``, g is already gated and promised >= lower_bound.
    ``cu_seqlens_cpu``: the host copy of a device ``cu_seqlens`` (``kda``)."""
    module = require("kda")
    return module.chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=_state(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm, safe_gate=_safe_gate(lower_bound),
        **_gate_kwargs(A_log, dt_bias, lower_bound), **_varlen_kwargs(cu_seqlens, q.device, cu_seqlens_cpu))


def fused_recurrent_inplace(q, k, v, g, beta, *, scale, state, use_qk_l2norm):
    """fla's fused recurrent decode with the final state written over ``state`` (fp32, contiguous):
    ``fused_recurrent_kda_fwd(inplace_final_state=True)``, the entry vLLM's decode uses, which the
    public ``fused_recurrent_kda`` does not expose. Returns o."""
    require("kda_step")
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: PLC0415  (lazy: triton)

    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o, _ = fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=scale if scale is not None else q.shape[-1] ** -0.5,
                                   initial_state=state, inplace_final_state=True,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm)
    return o


def fused_recurrent(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
                    cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None):
    """``fla.ops.kda.fused_recurrent_kda`` (forward only: decode). Shapes as ``chunk``."""
    module = require("kda_step")
    return module.fused_recurrent_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale,
        initial_state=_state(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm, **_gate_kwargs(A_log, dt_bias, lower_bound),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long))


def short_conv_packed(x, weight, cu_seqlens, cu_seqlens_cpu):
    """fla's varlen causal depthwise conv1d + SiLU (``fla.modules.causal_conv1d``, Triton forward and
    backward) on packed rows: x ``[1, T, C]`` in its dtype, weight ``[C, W]`` (fp32 here; the kernel
    loads and accumulates in fp32, and its weight gradient is summed in fp32), every sequence from a
    zero tail. The same arithmetic as ``ShortConv.forward_packed``'s torch path, which the GPU test
    holds it to, in two kernels a direction instead of about ten plus fp32 copies of the row."""
    require("short conv")
    from fla.modules.causal_conv1d import causal_conv1d  # noqa: PLC0415  (lazy: triton)

    y, _ = causal_conv1d(x, weight, activation="silu", **_varlen_kwargs(cu_seqlens, x.device, cu_seqlens_cpu))
    return y
