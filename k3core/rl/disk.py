"""Disk as a resource: the bytes a run's artifacts take under its artifact root, before it runs.

Owns: the size of one trainer state of a config (from a meta-device model: no weights are built),
of the prepared weights (fetched source, warm-up output, MXFP4 rollout weights), an upper bound of
an iteration's tables, the peak a run's remaining iterations need under its retention
(``--keep-checkpoints``, ``--save-every``), what a run has already published (a resume needs only
what remains), and the flags under which a run would fit a given free space.
Also: telling a full disk (``ENOSPC``, ``EDQUOT``) in an exception's chain (``disk_full_error``).
Does not own: refusing a run (``flows.preflight``), deleting checkpoints (``flows.retention``), or
what a full disk during a run prints (``flows.cli``). No Prefect; torch only for the meta model.

What a trainer state holds (``k3core.rl.trainer_state.save_trainer_state``): for each trainable
parameter element its fp32 master and two bf16 moments (8 B), the model's persistent buffers at
their dtype, no copy of the weights (the device weights are rounded from the master on load); each
tensor a ``torch.save`` record in DCP's data file, plus ``.metadata`` (one entry per tensor), the
RNG states, config.json, extra.json and the manifest. A checkpoint ``checkpoints/iter-v`` is hard
links of the trainer state ``iter-(v-1)/trainer``: its bytes are counted once.

Peak under retention: pruning runs after an iteration is recorded, so while a state is written
(staging) the kept ones are all still there: ``kept + 1`` states at once, ``kept`` being the newest
N (``--keep-checkpoints N``), at least the latest, and with ``--max-staleness K`` also the K
before it. ``--keep-checkpoints 0`` keeps every state written.
"""

from __future__ import annotations

import errno
import functools
import io
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from k3core.config import K3Config

__all__ = ["DISK_FULL", "DiskNeed", "RunProgress", "disk_full_error", "existing_dir", "fitting_flags", "free_bytes", "gb", "prepared_bytes",
           "run_config", "run_disk_need", "run_progress", "saved_versions", "state_entries", "states_at_peak",
           "table_bytes_per_iteration", "trainer_state_bytes", "with_pipeline"]

# Per DCP entry in ``.metadata``: its key, chunk metadata and tensor properties, pickled (an upper
# estimate of what torch writes per entry; the keys' own bytes are counted apart).
METADATA_BYTES_PER_ENTRY = 240
# config.json, extra.json (data cursor, metrics), the manifest, the completion markers, and the
# non-tensor entries (Python's RNG state, the optimizer's param groups, extra) with theirs.
STATE_FIXED_BYTES = 64 * 1024
# Per sampled position of a rollout row, beyond routing: the token id, its logprob, its loss mask,
# and its text in the row's strings (prompt, completion, turns: at most a few bytes per token).
ROW_BYTES_PER_TOKEN = 4 + 4 + 1 + 16
# Per iteration beyond the tables: curves, metrics and lineage records, Prefect's stage results.
ITERATION_FIXED_BYTES = 1 << 20
# Chat template and system prompt around an environment's prompt text, in tokens.
TEMPLATE_TOKENS = 256


def gb(n: int | float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@functools.cache
def _torch_save_overhead(dtype_name: str) -> int:
    """Bytes ``torch.save`` adds around one tensor's data (its zip records and pickle): DCP's data
    file holds one such record per tensor."""
    import torch

    dtype = getattr(torch, dtype_name)
    buf = io.BytesIO()
    torch.save(torch.zeros(1, dtype=dtype), buf)
    return len(buf.getvalue()) - dtype.itemsize


def _entries_bytes(entries: list[tuple[str, int, object]]) -> int:
    """Data and metadata bytes of DCP tensor entries (key, elements, dtype)."""
    data = sum(n * dt.itemsize + _torch_save_overhead(str(dt).removeprefix("torch.")) for _, n, dt in entries)
    meta = sum(METADATA_BYTES_PER_ENTRY + len(k) for k, _, _ in entries)
    return data + meta


def state_entries(config: K3Config, with_weights_dtype=None) -> list[tuple[str, int, object]]:
    """The tensor entries of a trainer state of ``config``: (DCP key, elements, dtype).
    ``with_weights_dtype``: also the model's parameters at that dtype (a state that stores the
    weights beside the master, as states written before the weights were dropped do)."""
    import torch

    from k3core.checkpoint.hf import meta_model

    model = meta_model(config)
    params = dict(model.named_parameters())
    out = []
    for name, t in model.state_dict().items():
        if name in params and params[name].requires_grad:  # its fp32 master is in the optimizer state
            if with_weights_dtype is not None:
                out.append((f"model.{name}", t.numel(), with_weights_dtype))
            continue
        out.append((f"model.{name}", t.numel(), t.dtype))  # a persistent buffer, a frozen parameter
    for name, p in params.items():
        if not p.requires_grad:
            continue
        out += [(f"optim.state.{name}.step", 1, torch.float32), (f"optim.state.{name}.master", p.numel(), torch.float32),
                (f"optim.state.{name}.exp_avg", p.numel(), torch.bfloat16),
                (f"optim.state.{name}.exp_avg_sq", p.numel(), torch.bfloat16)]
    out.append(("rng.torch", torch.get_rng_state().numel(), torch.uint8))
    return out


def trainer_state_bytes(config: K3Config, with_weights_dtype=None) -> int:
    """Bytes a trainer state of ``config`` takes on disk (8 B per trainable parameter element,
    persistent buffers at their dtype, the records and metadata around them)."""
    return _entries_bytes(state_entries(config, with_weights_dtype)) + STATE_FIXED_BYTES


def _layout_bytes(config: K3Config, target: str) -> int:
    from k3core.checkpoint.names import public_layout

    layout = public_layout(config, target)
    return sum(e.nbytes() for e in layout.entries) + 256 * len(layout.entries)  # safetensors headers, index


def prepared_bytes(config: K3Config, *, source: bool = True, warmup: bool = True, rollout_weights: bool = True,
                   source_bytes: int | None = None) -> int:
    """The prepared weights not yet published: the fetched source (``source_bytes`` when known, a
    local source's own size; else its public bf16 layout), the warm-up's bf16 policy, the MXFP4
    rollout weights (version 0)."""
    total = 0
    if source:
        total += source_bytes if source_bytes is not None else _layout_bytes(config, "bf16")
    if warmup:
        total += _layout_bytes(config, "bf16")
    if rollout_weights:
        total += _layout_bytes(config, "mxfp4")
    return total


def table_bytes_per_iteration(config: K3Config, s, prompt_tokens: int, agentic: bool = False) -> int:
    """An upper bound of one iteration's tables: ``rollouts.parquet`` and ``scored.parquet`` (which
    repeats every column), a refill round's pair each, ``ref-logprobs.parquet`` with ``--kl-coef``.
    Uncompressed: each position's routing (int16 per MoE layer and routed expert), token, logprob,
    mask and text. ``prompt_tokens``: the longest prompt, template included."""
    r = s.rollout
    out_tokens = r.max_episode_tokens if agentic else r.max_new_tokens
    positions = prompt_tokens + out_tokens
    routing = 2 * len(config.moe_layers) * config.num_experts_per_token
    rows = r.prompts_per_iteration * r.samples_per_prompt
    row = positions * (routing + ROW_BYTES_PER_TOKEN) + 256
    tables = rows * row * 2 * (1 + s.grpo.refill_rounds)
    if s.grpo.kl_coef:
        tables += rows * (out_tokens * 4 + 64)
    return tables + ITERATION_FIXED_BYTES


def saved_versions(iterations: int, save_every: int) -> list[int]:
    """Weight versions whose trainer state a run writes: every ``save_every``-th, and the last."""
    return [v for v in range(1, iterations + 1) if v % save_every == 0 or v == iterations]


def kept_states(keep: int, max_staleness: int) -> int | None:
    """How many states retention keeps at once (``flows.retention.checkpoints_to_keep``); None: all."""
    if keep <= 0:
        return None
    return max(keep, 1 + max_staleness)


def states_at_peak(writes: int, existing: int, keep: int, max_staleness: int) -> int:
    """States on disk at the peak beyond the ``existing`` ones, when ``writes`` more are written:
    each written beside the kept ones, then older ones pruned."""
    if writes <= 0:
        return 0
    kept = kept_states(keep, max_staleness)
    if kept is None:
        return writes
    return min(existing + writes - 1, max(existing, kept)) + 1 - existing


@dataclass(frozen=True)
class RunProgress:
    """What a run has published already under a local root (all empty for a new run)."""

    prepared: frozenset[str] = frozenset()  # of "source", "warmup", "rollout-weights-v0"
    iterations_done: int = 0  # iterations whose scored table is published
    latest_version: int = 0   # the version latest.json names
    states: int = 0           # trainer states on disk now


def run_progress(root: Path, run_id: str) -> RunProgress:
    from k3core.artifacts import COMPLETE
    from k3core.rl.layout import RunLayout

    layout = RunLayout(run_id)
    run = root / layout.rel()
    if not run.is_dir():
        return RunProgress()
    prepared = frozenset(n for n in ("source", "warmup", "rollout-weights-v0") if (run / n / COMPLETE).is_file())
    done = 0
    while (root / layout.iter_rel(done, "scored.parquet")).is_file():
        done += 1
    try:
        latest = int(json.loads((root / layout.latest).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        latest = 0
    states = sum(1 for p in run.glob("iter-*/trainer") if (p / COMPLETE).is_file())
    return RunProgress(prepared, done, latest, states)


@dataclass(frozen=True)
class DiskNeed:
    """The peak bytes a run's remaining work adds under its artifact root, by kind."""

    state_bytes: int
    states: int
    prepared: int
    tables: int

    @property
    def total(self) -> int:
        return self.states * self.state_bytes + self.prepared + self.tables

    def describe(self) -> str:
        bits = [f"{self.states} trainer state{'s' if self.states != 1 else ''} of {gb(self.state_bytes)} at once"]
        if self.prepared:
            bits.append(f"prepared weights {gb(self.prepared)}")
        bits.append(f"rollout and score tables {gb(self.tables)}")
        return ", ".join(bits)


def run_config(s) -> K3Config:
    """The config of the model run ``s`` trains: the fetched source's (``runs/<id>/tokenizer`` holds
    its config.json) on a resumed local run, a local source directory's, or the one ``init:`` makes
    (the preset's, its vocabulary sized to the bundled BPE for ``init:PRESET:SEED:bpe``)."""
    from k3core.rl.layout import RunLayout

    root, source = s.pipeline.artifacts, s.model.source
    candidates = []
    if "://" not in root or root.startswith("file://"):
        candidates.append(Path(root.removeprefix("file://"), RunLayout(s.pipeline.run_id).tokenizer, "config.json"))
    if source and not source.startswith("init:") and ("://" not in source or source.startswith("file://")):
        candidates.append(Path(source.removeprefix("file://"), "config.json"))
    for c in candidates:
        if c.is_file():
            return K3Config.from_json_file(c)
    config = K3Config.preset(s.model.preset)
    if source.startswith("init:") and source.split(":")[3:4] == ["bpe"]:
        from k3core.checkpoint.hf import _with_tokenizer

        config = _with_tokenizer(config, "bpe")[0]
    return config


def run_disk_need(s, progress: RunProgress = RunProgress(), prompt_tokens: int = 512, agentic: bool = False,
                  source_bytes: int | None = None, state_bytes: int | None = None) -> DiskNeed:
    """The peak bytes the rest of run ``s`` (``RLSettings``) adds to its artifact root, given what
    ``progress`` says is published already."""
    config = run_config(s)
    p = s.pipeline
    state = trainer_state_bytes(config) if state_bytes is None else state_bytes
    writes = len([v for v in saved_versions(p.iterations, p.save_every) if v > progress.latest_version])
    states = states_at_peak(writes, progress.states, p.keep_checkpoints, s.grpo.max_staleness)
    prep = prepared_bytes(config, source="source" not in progress.prepared,
                          warmup=s.warmup.runs() and "warmup" not in progress.prepared,
                          rollout_weights="rollout-weights-v0" not in progress.prepared, source_bytes=source_bytes)
    remaining = max(0, p.iterations - progress.iterations_done)
    tables = remaining * table_bytes_per_iteration(config, s, prompt_tokens, agentic)
    return DiskNeed(state, states, prep, tables)


def fitting_flags(s, free: int, need_of) -> list[str]:
    """Changes of ``s`` under which the run fits in ``free`` bytes, each with its need:
    ``--keep-checkpoints N`` (the largest N that fits), ``--save-every K`` (the smallest K, where
    keeping every state is what does not fit), else another ``--artifacts`` of at least the need.
    ``need_of``: settings -> ``DiskNeed`` (``run_disk_need`` with the run's progress)."""
    p = s.pipeline
    out = []
    for keep in range(p.keep_checkpoints - 1 if p.keep_checkpoints > 0 else p.iterations, 0, -1):
        n = need_of(with_pipeline(s, keep_checkpoints=keep))
        if n.total <= free:
            out.append(f"--keep-checkpoints {keep} (needs {gb(n.total)})")
            break
    if p.keep_checkpoints <= 0:
        for every in range(p.save_every + 1, p.iterations + 1):
            n = need_of(with_pipeline(s, save_every=every))
            if n.total <= free:
                out.append(f"--save-every {every} (needs {gb(n.total)})")
                break
    out.append(f"another --artifacts with at least {gb(need_of(s).total)} free")
    return out


def with_pipeline(s, **pipeline):
    """``s`` with pipeline settings changed (validated again)."""
    return replace(s, pipeline=replace(s.pipeline, **pipeline))


def existing_dir(path: Path) -> Path:
    """``path``, or the nearest directory above it that exists (where a new root would be made)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds (or would hold) ``path``."""
    return shutil.disk_usage(existing_dir(path)).free


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left; the user's quota on the filesystem is exhausted


def disk_full_error(exc: BaseException | None) -> OSError | None:
    """The full disk's ``OSError`` that ``exc`` is or was raised from (its ``__cause__`` and
    ``__context__`` chain), None when a full disk is not behind it."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
