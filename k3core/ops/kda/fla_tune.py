"""Make the fla kernel configs k3rl ships, so that fla reads them instead of autotuning.

Owns: the list of KDA calls k3rl makes on CUDA (``call_groups()``: the presets' head shapes in
training, packed training, prefill and decode, and the shapes of the GPU tests), running each once
with fla's autotuning on, and writing the winners in fla 0.6's config format: one
``<kernel>.json`` per kernel, its entries keyed by the md5 of the Triton autotune key, into
``fla_configs/<fla-core version>/<GPU>/``, with a MANIFEST.json of what was run and finished.
Does not own: reading them (fla, ``fla/ops/utils/cache.py``) or pointing fla at them
(``_fla.point_fla_at_shipped_configs``).

Run on the GPU the configs are for, with fla installed (writes the shipped directory by default):

    python3 -m k3core.ops.kda.fla_tune [--only GROUP ...] [--deadline 540] [--fresh] [--list]

Each group of calls runs in its own fresh process (so each group's first call is a first call),
``--workers`` groups at a time (default 1: groups in parallel slowed each other until none
finished, docs/results/kda_first_call.md), sharing one fresh Triton cache directory. A worker
writes its winners after every call and every 10 s, so a group cut off by ``--deadline`` keeps
every kernel it finished tuning; the next run resumes: it reads the entries already shipped (fla's
strict mode: exact keys only) and tunes only what is missing (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from k3core.config import K3Config

# training sequence length (tokens per batch row) and batch size used to tune each preset's shape;
# the autotune keys hold no sequence length, so these only decide what the timings were taken on
PRESET_TOKENS = {"full": (1, 8192), "medium": (2, 4096), "small": (2, 1024), "tiny": (2, 256)}
TEST_HEADS = (4, 64)  # tests/k3core/ops/test_kda.py's fla-vs-torch shape (H, K = V)
SHORT = {"bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class KDACall:
    """One ``kda``/``kda_step`` call on CUDA. The Triton autotune key of each kernel is its key
    arguments plus the dtype of every tensor it gets, so dtypes, packing (``cu_seqlens``), state in
    and out and backward each make their own keys; head count and head dim do too."""

    name: str
    heads: int
    head_dim: int
    dtype: str = "bfloat16"  # q, k, v
    beta_dtype: str = "float32"  # the model's beta is fp32; the GPU tests use q's dtype
    gate: str = "safe"  # safe: pre-gated g + lower_bound (the model); general: no bound; raw: gate in kernel
    batch: int = 2
    seq_len: int = 1024
    packed: bool = False  # cu_seqlens over 4 sequences, batch 1
    state: bool = False  # initial_state in and final_state out (chunked prefill, the GPU tests)
    final_state: bool = False  # final_state out only (rollout prefill)
    backward: bool = True
    decode: bool = False  # one token through kda_step (fused recurrent kernel)


def _preset_calls(preset: str, dtype: str) -> list[KDACall]:
    cfg = K3Config.preset(preset)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    B, T = PRESET_TOKENS[preset]
    tag = f"{preset}-{SHORT[dtype]}"
    return [KDACall(f"{tag}-train", H, K, dtype, batch=B, seq_len=T),
            KDACall(f"{tag}-prefill", H, K, dtype, batch=B, seq_len=T, final_state=True, backward=False),
            KDACall(f"{tag}-decode", H, K, dtype, batch=B, seq_len=1, state=True, backward=False, decode=True)]


def _packed_calls(preset: str, dtype: str, with_state: bool) -> list[KDACall]:
    cfg = K3Config.preset(preset)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    B, T = PRESET_TOKENS[preset]
    tag = f"{preset}-{SHORT[dtype]}-packed"
    calls = [KDACall(f"{tag}-train", H, K, dtype, batch=1, seq_len=B * T, packed=True)]
    if with_state:  # the fla-vs-torch test at a training shape (state in and out, packed)
        calls.append(KDACall(f"{tag}-state", H, K, dtype, batch=1, seq_len=B * T,
                             packed=True, state=True))
    return calls


def _test_calls(dtype: str, gate: str) -> list[KDACall]:
    H, K = TEST_HEADS
    tag = f"test-{SHORT[dtype]}-{gate}"
    return [KDACall(f"{tag}-fixed", H, K, dtype, dtype, gate, batch=2, seq_len=300, state=True),
            KDACall(f"{tag}-packed", H, K, dtype, dtype, gate, batch=1, seq_len=1000, packed=True, state=True)]


def call_groups() -> dict[str, list[KDACall]]:
    """Groups of calls, one process each, largest shapes first (they take longest to tune)."""
    groups = {
        "full-bf16": _preset_calls("full", "bfloat16"),
        "full-bf16-packed": _packed_calls("full", "bfloat16", with_state=False),
        "medium-bf16": _preset_calls("medium", "bfloat16"),
        "medium-bf16-packed": _packed_calls("medium", "bfloat16", with_state=True),
        "medium-fp32-packed": _packed_calls("medium", "float32", with_state=True),
    }
    for preset in ("small", "tiny"):
        for dtype in ("bfloat16", "float32"):
            groups[f"{preset}-{SHORT[dtype]}"] = _preset_calls(preset, dtype)
        groups[f"{preset}-bf16-packed"] = _packed_calls(preset, "bfloat16", with_state=False)
    for dtype in ("float32", "bfloat16"):
        for gate in ("safe", "general", "raw"):
            groups[f"test-{SHORT[dtype]}-{gate}"] = _test_calls(dtype, gate)
    return groups


# ----------------------------------------------------------------------------- one call

def packed_lengths(total: int) -> list[int]:
    """Four uneven sequences, none a multiple of fla's 64-token chunk (partial chunks everywhere)."""
    cuts = [0, round(total * 0.13), round(total * 0.58), round(total * 0.87), total]
    return [b - a for a, b in zip(cuts[:-1], cuts[1:])]


def run_call(call: KDACall, device: str = "cuda") -> None:
    """Run ``call`` once through k3core's dispatch (``backend="fla"``) and wait for the GPU."""
    from k3core.ops.kda import kda, kda_gate, kda_step

    gen = torch.Generator().manual_seed(0)
    B, T, H, K = call.batch, call.seq_len, call.heads, call.head_dim
    dt, beta_dt = getattr(torch, call.dtype), getattr(torch, call.beta_dtype)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = (rnd(B, T, H, K).to(device, dt) for _ in range(3))
    f = rnd(B, T, H, K).to(device, dt)
    A_log, dt_bias = (rnd(H) * 0.5).to(device), (torch.rand(H * K, generator=gen) * 5 - 4).to(device)
    beta = torch.rand(B, T, H, generator=gen).to(device, beta_dt)
    kw = {}
    if call.gate == "raw":
        g, kw = f, dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    else:
        g = kda_gate(f, A_log, dt_bias, -5.0)
        if call.gate == "safe":
            kw["lower_bound"] = -5.0
    cu = None
    if call.packed:
        cu = torch.tensor([0, *packed_lengths(T)], device=device).cumsum(0)
    n_states = len(cu) - 1 if cu is not None else B
    h0 = rnd(n_states, H, K, K).to(device) * 0.5 if call.state else None
    if call.decode:
        with torch.no_grad():
            kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0)
        torch.cuda.synchronize()
        return
    leaves = [q, k, v, g, beta]
    if call.backward:
        leaves = [x.detach().requires_grad_() for x in leaves]
    with torch.set_grad_enabled(call.backward):
        o, s = kda(*leaves, initial_state=h0, output_final_state=call.state or call.final_state,
                   cu_seqlens=cu, backend="fla", **kw)
        if call.backward:
            loss = o.float().square().sum()
            if s is not None:
                loss = loss + s.square().sum()
            loss.backward()
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- fla's autotuners

def fla_autotuners() -> list:
    """Every Triton autotuner in the loaded fla modules (unwrapping ``triton.heuristics``)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(module).values()):
            while isinstance(obj, KernelInterface) and not isinstance(obj, Autotuner):
                obj = getattr(obj, "fn", None)
            if isinstance(obj, Autotuner):
                found[id(obj)] = obj
    return list(found.values())


def autotuned_kernels() -> dict[str, list[str]]:
    """Kernels that ran Triton's benchmark (or read its disk cache) in this process, by the kind of
    autotuner: ``fla`` (reads fla's config files) or ``triton`` (plain ``triton.autotune``)."""
    from fla.ops.utils.cache import CachedAutotuner

    out = {"fla": [], "triton": []}
    for tuner in fla_autotuners():
        if hasattr(tuner, "configs_timings"):
            out["fla" if isinstance(tuner, CachedAutotuner) else "triton"].append(tuner.base_fn.__name__)
    return {kind: sorted(names) for kind, names in out.items()}


def _config_key(cfg: dict) -> tuple:
    return (tuple(sorted(cfg["kwargs"].items())), cfg["num_warps"], cfg["num_stages"])


def shipped_winners(out: Path | None) -> dict[str, list[dict]]:
    """Per kernel, the distinct configs that won at any key in ``out`` (most frequent first)."""
    found: dict[str, dict[tuple, tuple[int, dict]]] = {}
    for path in sorted(out.glob("*.json")) if out is not None and out.is_dir() else []:
        if path.name == "MANIFEST.json":
            continue
        for entry in json.loads(path.read_text())["autotune_entries"].values():
            seen = found.setdefault(path.stem, {})
            k = _config_key(entry["config"])
            n, _ = seen.get(k, (0, entry["config"]))
            seen[k] = (n + 1, entry["config"])
    return {name: [c for _, c in sorted(v.values(), key=lambda nc: -nc[0])] for name, v in found.items()}


def pick_candidates(configs: list, prior: list[dict], n: int) -> list:
    """At most ``n`` of a kernel's autotune ``configs``: those that already won for it at other keys
    on this GPU first (at most half of ``n``), then configs spread evenly over fla's list, which runs
    from small tiles, few warps and stages to large ones (so the pick spans both ends; a candidate
    that does not fit shared memory at this shape is skipped by Triton's benchmark as it always is)."""
    if len(configs) <= n:
        return list(configs)
    keys = [(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in configs]
    chosen: list[int] = []
    for cfg in prior:
        k = _config_key(cfg)
        if k in keys and keys.index(k) not in chosen and len(chosen) < max(1, n // 2):
            chosen.append(keys.index(k))
    spread = [round(i * (len(configs) - 1) / max(1, n - 1)) for i in range(n)]
    for i in [spread[0], spread[-1], *spread[1:-1], *range(len(configs))]:  # both ends first
        if len(chosen) >= n:
            break
        if i not in chosen:
            chosen.append(i)
    return [configs[i] for i in sorted(chosen)]


def limit_candidates(n: int, prior: dict[str, list[dict]]) -> None:
    """Make every Triton autotuner of this process benchmark at most ``n`` candidates (``n >= 2``:
    with one config Triton records no winner). Compiling every candidate of every KDA kernel is what
    makes fla's first call take minutes: a full-size forward+backward compiles hundreds of kernel
    variants. Patched on the class, so kernels of modules imported later are limited too."""
    from triton.runtime.autotuner import Autotuner

    if n < 2:
        raise SystemExit("fla_tune: --max-configs must be at least 2 (Triton records no winner for one config)")
    if getattr(Autotuner, "_k3rl_limited", None) is not None:
        return
    original = Autotuner.run

    def run(self, *args, **kwargs):
        if not getattr(self, "_k3rl_limited", False):
            self._k3rl_all_configs = len(self.configs)
            name = getattr(self, "kernel_name", None) or self.base_fn.__name__
            self.configs = pick_candidates(self.configs, prior.get(name, []), n)
            self._k3rl_limited = True
        return original(self, *args, **kwargs)

    Autotuner.run = run
    Autotuner._k3rl_limited = n


def _config_dict(cfg) -> dict:
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": cfg.num_ctas, "maxnreg": cfg.maxnreg, "ir_override": cfg.ir_override}


def winners() -> dict:
    """fla-format entries of every fla autotuner's in-memory winners, plus the plain Triton
    autotuners that tuned (fla never reads configs for those)."""
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    kernels, plain, skipped = {}, {}, []
    for tuner in fla_autotuners():
        if not tuner.cache:
            continue
        if not isinstance(tuner, CachedAutotuner):
            plain[tuner.base_fn.__name__] = [[str(x) for x in key] for key in tuner.cache]
            continue
        entries = kernels.setdefault(tuner.kernel_name, {})
        for key, cfg in tuner.cache.items():
            try:
                digest = AutotuneKey.key_hash(key)
            except TypeError:  # a key fla cannot serialise cannot be looked up either
                skipped.append(f"{tuner.kernel_name}: {key}")
                continue
            entries[digest] = {"autotune_key": AutotuneKey.normalize_autotune_key(key),
                               "config": _config_dict(cfg)}
    return {"kernels": kernels, "plain_triton_autotune": plain, "unserialisable_keys": skipped}


def _write_json(path: Path, data) -> None:
    """Atomic write, keys in insertion order (the order of a config file's entries is meaningful)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _versions() -> dict:
    import importlib.metadata

    import triton

    from k3core.ops.kda._fla import gpu_arch, gpu_config_name

    return {"fla_core": importlib.metadata.version("fla-core"), "triton": triton.__version__,
            "torch": torch.__version__, "gpu": gpu_config_name(), "gpu_name": torch.cuda.get_device_name(),
            "arch": gpu_arch()}


def run_group(group: str, dump: Path, every: float = 10.0, max_configs: int = 0,
              pytest_args: list[str] | None = None) -> None:
    """Worker: run one group's calls in order (``group`` may be several names joined by ``,``),
    writing the winners after each call and every ``every`` seconds in between (a full-model call
    tunes for minutes: a kill keeps what is done). With ``pytest_args`` the calls are instead the
    ones pytest's tests make (exactly the keys the GPU tests need)."""
    mode = os.environ.get("FLA_CACHE_MODE")
    if mode not in ("disabled", "strict"):  # strict: resume, reading exact keys tuned before
        raise SystemExit(f"fla_tune worker: FLA_CACHE_MODE must be 'disabled' or 'strict', got {mode!r}")
    from k3core.ops.kda import _fla

    groups = call_groups()
    calls = [] if pytest_args is not None else [c for g in group.split(",") for c in groups[g]]
    done, failed = [], []
    t0 = time.perf_counter()
    assert _fla.available(), "fla must import"
    if max_configs:
        limit_candidates(max_configs, shipped_winners(Path(os.environ["K3RL_FLA_PRIOR"]))
                         if os.environ.get("K3RL_FLA_PRIOR") else {})
    print(f"[{group}] import fla: {time.perf_counter() - t0:.1f} s (FLA_CACHE_MODE={mode})", flush=True)
    versions, lock, stop = _versions(), threading.Lock(), threading.Event()

    def write() -> None:
        with lock:
            _write_json(dump, {"group": group, "calls_done": list(done), "versions": versions, **winners()})

    def write_periodically() -> None:
        while not stop.wait(every):
            try:
                write()
            except RuntimeError:  # a tuner's cache grew while it was read: next time
                pass

    threading.Thread(target=write_periodically, daemon=True).start()
    if pytest_args is not None:
        import pytest

        rc = pytest.main(pytest_args)
        done.append(group)
        write()
        stop.set()
        print(f"[{group}] pytest exit status {int(rc)}", flush=True)
        return
    for call in calls:
        t0 = time.perf_counter()
        try:
            run_call(call)
        except Exception:  # the group's other calls still tune; the group's exit status says so
            traceback.print_exc()
            failed.append(call.name)
            continue
        seconds = time.perf_counter() - t0
        done.append(call.name)
        tuned = autotuned_kernels()
        print(f"[{group}] {call.name}: {seconds:.1f} s (fla kernels tuned so far: {len(tuned['fla'])}, "
              f"plain triton: {len(tuned['triton'])})", flush=True)
        write()
    stop.set()
    if failed:
        raise SystemExit(f"[{group}] failed calls: {failed}")


# ----------------------------------------------------------------------------- parent

def _size(key: list) -> tuple:
    nums = [x for x in key if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return (max(nums, default=0), sum(nums))


def _identity(versions: dict) -> tuple:
    """What decides whether a config applies: the fla kernels, the compiler and the GPU."""
    return versions["fla_core"], versions["triton"], versions["gpu"]


def import_triton_autotune(source: Path, out: Path, triton_version: str) -> dict:
    """Add the winners in a Triton autotune disk cache (``<kernel>.autotune.json`` files, written
    with ``TRITON_CACHE_AUTOTUNING=1``; a directory or a .tgz of one) to ``out``, whose path names
    the fla version and GPU they were tuned on (``.../<fla-core version>/<GPU>``). Triton keys its
    autotune results exactly as fla's cache does (key arguments, then every tensor's dtype), and its
    winner is the config of least median time, as in ``Autotuner.run``."""
    import tarfile

    scratch = Path(tempfile.mkdtemp(prefix="k3rl_fla_import_"))
    if source.is_file():
        with tarfile.open(source) as tar:
            tar.extractall(scratch / "src", filter="data")
        root = scratch / "src"
    else:
        root = source
    best: dict[str, dict[str, tuple]] = {}
    for path in sorted(root.rglob("*.autotune.json")):
        data = json.loads(path.read_text())
        key = data["key"]
        config, timings = min(data["configs_timings"], key=lambda ct: ct[1])
        digest = hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()
        kernel = path.name[: -len(".autotune.json")]
        entry = {"autotune_key": key, "config": {n: config.get(n) for n in
                                                   ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")}}
        seen = best.setdefault(kernel, {})
        if digest not in seen or timings < seen[digest][0]:
            seen[digest] = (timings, entry)
    if not best:
        raise SystemExit(f"fla_tune: no *.autotune.json under {source}")
    versions = {"fla_core": out.parent.name, "triton": triton_version, "gpu": out.name}
    dump = scratch / "imported.json"
    _write_json(dump, {"group": None, "calls_done": [], "versions": versions,
                       "kernels": {k: {d: e for d, (_, e) in v.items()} for k, v in best.items()},
                       "plain_triton_autotune": {}, "imported_from": [source.name]})
    return merge([dump], out, {}, {}, keep=True)


def _read_shipped(out: Path) -> tuple[dict, dict]:
    """The entries and manifest already in ``out`` (empty when there are none)."""
    kernels = {}
    for path in sorted(out.glob("*.json")):
        if path.name != "MANIFEST.json":
            kernels[path.stem] = json.loads(path.read_text())["autotune_entries"]
    manifest_path = out / "MANIFEST.json"
    return kernels, (json.loads(manifest_path.read_text()) if manifest_path.exists() else {})


def merge(dumps: list[Path], out: Path, groups: dict[str, list[KDACall]], status: dict[str, str],
          keep: bool) -> dict:
    """Write one fla config file per kernel into ``out`` and MANIFEST.json; with ``keep``, the
    entries and manifest already there stay (a resumed or partial run adds to them).
    Within a file, entries run largest key first: k3rl reads them in fla's strict mode (exact keys),
    but a user's fuzzy mode takes the first entry whose key differs only in numbers, and a config
    that fit the largest shape is the likelier to fit a smaller one."""
    kernels, old = _read_shipped(out) if keep else ({}, {})
    plain = set(old.get("plain_triton_autotune_not_shippable", []))
    sources = set(old.get("imported_from", []))
    versions, done = old.get("versions"), dict(old.get("calls_done", {}))
    for path in dumps:  # group order: for a key tuned twice, the first winner stays
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        if versions is not None and _identity(versions) != _identity(data["versions"]):
            raise SystemExit(f"fla_tune: {out} holds configs of {versions}, this run is {data['versions']}")
        versions = data["versions"]
        sources.update(data.get("imported_from", []))
        for g in (data["group"] or "").split(","):  # None: imported winners, no call of ours was run
            if not g or g == "pytest":
                continue
            names = {c["name"] for c in old.get("calls", {}).get(g, [])} | {c.name for c in groups.get(g, [])}
            ours = [c for c in data["calls_done"] if c in names]
            done[g] = sorted(set(done.get(g, [])) | set(ours))
        plain.update(data["plain_triton_autotune"])
        for name, entries in data["kernels"].items():
            merged = kernels.setdefault(name, {})
            for digest, entry in entries.items():
                merged.setdefault(digest, entry)
    if versions is None:
        raise SystemExit("fla_tune: no group wrote any winners")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.json"):
        stale.unlink()
    for name, entries in sorted(kernels.items()):
        ordered = dict(sorted(entries.items(), key=lambda kv: (_size(kv[1]["autotune_key"]), kv[0]), reverse=True))
        _write_json(out / f"{name}.json", {"kernel_name": name, "triton_version": versions["triton"],
                                           "autotune_entries": ordered})
    calls = {**old.get("calls", {}), **{g: [asdict(c) for c in cs] for g, cs in groups.items()}}
    manifest = {
        "made_by": "python3 -m k3core.ops.kda.fla_tune",
        "versions": versions,
        "calls": calls,
        "group_status": {**old.get("group_status", {}), **status},
        "calls_done": done,
        "calls_not_done": {g: [c["name"] for c in cs if c["name"] not in done.get(g, [])]
                           for g, cs in calls.items() if len(done.get(g, [])) < len(cs)},
        "entries": {name: len(e) for name, e in sorted(kernels.items())},
        "plain_triton_autotune_not_shippable": sorted(plain),
        "imported_from": sorted(sources),
    }
    _write_json(out / "MANIFEST.json", manifest)
    return manifest


def tune(out: Path, workers: int, deadline: float, logs: Path, only: list[str] | None, resume: bool,
         max_configs: int = 0, pytest_args: list[str] | None = None) -> dict:
    groups = call_groups()
    if only:
        unknown = sorted(set(only) - set(groups))
        if unknown:
            raise SystemExit(f"fla_tune: unknown groups {unknown}; --list shows them")
        groups = {g: groups[g] for g in only}
    if pytest_args is not None:
        groups, jobs = {}, ["pytest"]  # the tests' calls are not ours to list: group_status records the run
    elif max_configs:
        # candidates limited: one process for all groups (each fresh process pays ~20 s to import
        # fla and torch, more than a limited group takes to tune)
        jobs = [",".join(groups)]
    else:
        jobs = list(groups)
    scratch = Path(tempfile.mkdtemp(prefix="k3rl_fla_tune_"))
    logs.mkdir(parents=True, exist_ok=True)
    # tune in a fresh Triton cache shared by the workers, results on disk; resuming, read the exact
    # keys already in `out` (strict: nothing else) so only what is missing is tuned
    env = {**os.environ, "FLA_CACHE_MODE": "disabled", "TRITON_CACHE_AUTOTUNING": "1",
           "TRITON_CACHE_DIR": str(scratch / "triton"), "PYTHONUNBUFFERED": "1", "K3RL_FLA_PRIOR": str(out)}
    env.pop("FLA_CONFIG_DIR", None)
    if resume and any(out.glob("*.json")):
        env.update(FLA_CACHE_MODE="strict", FLA_CONFIG_DIR=str(out))
    pending, running, status = list(jobs), {}, {}
    start = time.monotonic()
    while pending or running:
        while pending and len(running) < workers:
            g = pending.pop(0)
            log = open(logs / f"{g[:80].replace(',', '+')}.log", "w")  # closed when the process ends
            cmd = [sys.executable, "-m", "k3core.ops.kda.fla_tune", "--worker", g, "--dump", str(scratch / f"{g[:80]}.json")]
            if max_configs:
                cmd += ["--max-configs", str(max_configs)]
            if pytest_args is not None:
                cmd += ["--pytest", *pytest_args]
            running[g] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, time.monotonic())
        for g, (proc, log, t0) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                status[g] = f"rc={proc.returncode} after {time.monotonic() - t0:.0f} s"
                print(f"fla_tune: {g} {status[g]}", flush=True)
                del running[g]
        if time.monotonic() - start > deadline:
            for g, (proc, log, t0) in running.items():
                proc.kill()
                proc.wait()
                log.close()
                status[g] = f"killed at the {deadline:.0f} s deadline after {time.monotonic() - t0:.0f} s"
                print(f"fla_tune: {g} {status[g]}", flush=True)
            for g in pending:
                status[g] = "not started before the deadline"
            running, pending = {}, []
        time.sleep(0.2)
    manifest = merge([scratch / f"{g[:80]}.json" for g in jobs], out, groups, status, keep=resume)
    print(f"fla_tune: {sum(manifest['entries'].values())} entries for {len(manifest['entries'])} kernels "
          f"in {out} after {time.monotonic() - start:.0f} s; calls not done: {manifest['calls_not_done']}", flush=True)
    if manifest["plain_triton_autotune_not_shippable"]:
        print("fla_tune: tuned by plain triton.autotune (fla cannot ship these): "
              + ", ".join(manifest["plain_triton_autotune_not_shippable"]), flush=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="default: the shipped directory for this fla and GPU")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds; groups still running are cut off")
    ap.add_argument("--logs", type=Path, default=Path("out/fla_tune_logs"))
    ap.add_argument("--only", nargs="*", help="group names, run in this order (default: all)")
    ap.add_argument("--fresh", action="store_true",
                    help="tune everything again and replace the directory (default: keep its entries, tune what is missing)")
    ap.add_argument("--import-triton-cache", type=Path, metavar="DIR_OR_TGZ",
                    help="add the winners of a Triton autotune disk cache to --out (no GPU needed), then stop")
    ap.add_argument("--triton-version", help="with --import-triton-cache: the Triton that tuned them")
    ap.add_argument("--max-configs", type=int, default=0, metavar="N",
                    help="benchmark at most N candidates per kernel (prior winners on this GPU first, then "
                         "a spread of fla's list); all groups in one process. 0: every candidate")
    ap.add_argument("--pytest", nargs=argparse.REMAINDER, metavar="PYTEST_ARGS",
                    help="tune the calls these pytest arguments make (e.g. --pytest -m gpu tests), instead of the groups")
    ap.add_argument("--list", action="store_true", help="print the groups and calls, run nothing")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for g, calls in call_groups().items():
            print(g)
            for c in calls:
                print("   ", c)
        return 0
    if args.worker:
        run_group(args.worker, args.dump, max_configs=args.max_configs, pytest_args=args.pytest)
        return 0
    if args.import_triton_cache:
        if args.out is None or not args.triton_version:
            raise SystemExit("--import-triton-cache needs --out .../<fla-core version>/<GPU> and --triton-version")
        manifest = import_triton_autotune(args.import_triton_cache, args.out, args.triton_version)
        print(f"fla_tune: {sum(manifest['entries'].values())} entries for {len(manifest['entries'])} kernels in {args.out}")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("fla_tune: needs a CUDA device (configs are per GPU)")
    out = args.out
    if out is None:
        import importlib.metadata

        from k3core.ops.kda._fla import SHIPPED_CONFIGS, gpu_config_name

        out = SHIPPED_CONFIGS / importlib.metadata.version("fla-core") / gpu_config_name()
    manifest = tune(out, args.workers, args.deadline, args.logs, args.only, resume=not args.fresh,
                    max_configs=args.max_configs, pytest_args=args.pytest)
    return 1 if manifest["calls_not_done"] else 0


if __name__ == "__main__":
    sys.exit(main())
