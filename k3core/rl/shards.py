"""Rollout shards: one rollout's prompts split over N engines, with a table that is the same, row for
row, whatever N is; and the resident engines of a worker process.

Owns: where shards cut (``shard_bounds``: contiguous runs of prompt positions, a pure function of
the prompt count and N), generating one shard (``shard_table``; ``ShardRequest`` carries what a
shard needs to a worker process), putting shard tables back in the one-engine order
(``merge_shards``), and ``ResidentEngines``: a worker's engines, one per run, built once and then
pushed each newer weight version (``k3core.transfer.push_inprocess``, which refuses a version that
is not newer). Does not own: the worker processes that keep a ``ResidentEngines`` (the Dask
plugin and the Ray engine actors: ``k3core.rl.resident``), placing shards on them (Prefect's task
runner), storage (the caller publishes tables), or the engine itself.

Why N does not change the table: prompt ``i`` of a rollout gets request seed
``derive_seed(seed, i)`` in whichever shard it lands (``RolloutEngine.generate(first_index=...)``),
every sample is drawn from its own generator by inverse CDF, and rows are merged by
(prompt_index, sample_index). What batch composition can change is floating-point rounding: the
matrix products of a batch of other rows may block differently, so log-probabilities can differ in
their last bits between N values, and a token drawn within that rounding of a CDF boundary could
differ. Token ids, routing and versions are compared exactly by the tests; log-probabilities to
rounding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

__all__ = ["ResidentEngines", "ShardRequest", "StaleWeightVersion", "merge_shards", "shard_bounds", "shard_table"]


class StaleWeightVersion(RuntimeError):
    """A shard asked a resident engine for a weight version older than the one it serves."""


def shard_bounds(prompts: int, shards: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``shards`` contiguous runs covering ``prompts`` positions, sizes
    differing by at most one (empty runs when there are fewer prompts than shards)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return [(k * prompts // shards, (k + 1) * prompts // shards) for k in range(shards)]


def shard_table(engine, fmt, prompts: list[str], bounds: tuple[int, int], params, iteration: int,
                first_prompt_index: int, worker: str, prompt_ids=None, episode_limits=None,
                env_spec: str | None = None) -> pa.Table:
    """Rows of ``prompts[start:stop]`` as the whole rollout would give them (seeds and prompt
    indices of their positions), each marked with ``worker``; an empty shard has no rows. ``fmt``: a
    ``k3core.rl.prompting.PromptFormat``; ``prompt_ids``: every prompt's ids, rendered by the caller.
    An agentic environment (``fmt.env`` with tools) runs the shard's episodes within
    ``episode_limits``, its tools where ``tools_of(env, env_spec)`` says, as ``rollout_table`` does."""
    from k3core.rl.tables import rollout_table

    start, stop = bounds
    if start == stop:  # more shards than prompts
        from k3core.rl.data import ROLLOUT_SCHEMA

        return ROLLOUT_SCHEMA.empty_table()
    return rollout_table(engine, fmt, prompts[start:stop], params, iteration, first_prompt_index, shard_start=start,
                         worker=worker, prompt_ids=None if prompt_ids is None else prompt_ids[start:stop],
                         episode_limits=episode_limits, env_spec=env_spec)


@dataclass(frozen=True)
class ShardRequest:
    """One rollout shard as a worker process receives it (plain data, pickled to a Dask task or a Ray
    actor): the weights to serve (``path`` of a public-layout checkpoint, or of a DCP trainer state:
    ``kind`` "dcp"; ``version``; ``quantized``: MXFP4 routed experts on the W4A8 engine), all of the
    rollout's ``prompts`` and this shard's ``bounds`` in them, and the rollout's sampling ``params``
    (a ``SamplingParams``), ``iteration`` and ``first_prompt_index``; ``dtype``: the engine's weights
    (the run's ``--dtype``, as the trainer's); ``prompt_ids``: every prompt's token ids, rendered by
    the stage (``k3core.rl.prompting``), ``tokenizer``: the run's tokenizer directory (data files and
    config.json, ``RunLayout.tokenizer``) and ``chat``: whether completions end at end-of-turn ids.
    ``env``: the spec of an agentic environment (None for a single-turn one, whose prompts arrive
    rendered): the worker loads it and runs whole episodes within ``episode_limits`` (an
    ``EpisodeLimits``), its tools in the worker's reward sandbox as the one-engine rollout runs them."""

    run_id: str
    path: str
    kind: str
    version: int
    quantized: bool
    prompts: tuple[str, ...]
    bounds: tuple[int, int]
    params: object
    iteration: int
    first_prompt_index: int = 0
    dtype: str = "float32"
    prompt_ids: tuple[tuple[int, ...], ...] | None = None
    tokenizer: str | None = None
    chat: bool = False
    env: str | None = None
    episode_limits: object = None


def merge_shards(tables: list[pa.Table], prompts: int, samples: int, first_prompt_index: int = 0) -> pa.Table:
    """The shards' rows in the one-engine order (prompt, then sample); every (prompt, sample) of the
    rollout exactly once, or ``ValueError`` naming what is missing or doubled."""
    table = pa.concat_tables([t for t in tables if t.num_rows]) if any(t.num_rows for t in tables) else tables[0]
    keys = list(zip(table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist()))
    want = {(first_prompt_index + p, s) for p in range(prompts) for s in range(samples)}
    if len(keys) != len(set(keys)) or set(keys) != want:
        missing, extra = sorted(want - set(keys)), len(keys) - len(set(keys))
        raise ValueError(f"rollout shards do not cover the rollout: {len(missing)} (prompt, sample) pairs missing "
                         f"(first {missing[:3]}), {extra} doubled")
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return table.take(order)


class ResidentEngines:
    """A worker process's rollout engines, one per run id, kept across rollouts.

    ``engine(run_id, path, kind, version, quantized)``: the engine at ``version``. The first call
    builds it from the weights at ``path`` (a public-layout checkpoint, or a DCP trainer state:
    ``kind`` "dcp"); a later call with a newer version pushes those weights into the same engine;
    an older version is refused (``StaleWeightVersion``): an engine only moves forward, and a
    rollout at an old version must not be served by newer weights."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, object] = {}
        self.builds = 0
        self.pushes = 0

    def engine(self, run_id: str, path: str | Path, kind: str, version: int, quantized: bool,
               dtype: str = "float32"):
        with self._lock:
            eng = self._engines.get(run_id)
            if eng is not None and eng.weight_version == version:
                return eng
            if eng is not None and version < eng.weight_version:
                raise StaleWeightVersion(f"run {run_id!r}: this worker's engine serves weight version "
                                         f"{eng.weight_version}, a rollout asked for the older version {version}; "
                                         "rerun the rollout on a fresh worker (or a new run id)")
            if eng is not None and kind == "dcp":
                from k3core.device import torch_dtype
                from k3core.rl.trainer_state import load_trainer_model
                from k3core.transfer import push_inprocess

                push_inprocess(eng, load_trainer_model(path, torch_dtype(dtype)).state_dict(), version,
                               quantize_experts=quantized)
                self.pushes += 1
                return eng
            eng = self._build(path, kind, version, quantized, dtype)
            self._engines[run_id] = eng
            self.builds += 1
            return eng

    @staticmethod
    def _build(path, kind: str, version: int, quantized: bool, dtype: str = "float32"):
        from k3core.device import torch_dtype
        from k3core.rl.weights import build_engine, engine_from_model

        if kind == "dcp":
            from k3core.rl.trainer_state import load_trainer_model

            return engine_from_model(load_trainer_model(path, torch_dtype(dtype)), version, quantized=quantized)
        return build_engine(path, version, torch_dtype(dtype))

    def rollout(self, req: ShardRequest, worker: str) -> pa.Table:
        """The rows of shard ``req`` on this holder's engine for ``req.run_id`` at ``req.version``
        (built or pushed as ``engine`` says), each marked with ``worker``. Rows that carry another
        weight version are refused (``WeightVersionMismatch``): the engine changed under the shard."""
        from k3core.rollout.client import WeightVersionMismatch
        from k3core.rl.prompting import PromptFormat
        from k3core.tokenizer import ByteTokenizer, load_tokenizer

        eng = self.engine(req.run_id, req.path, req.kind, req.version, req.quantized, req.dtype)
        config = eng.model.config
        tok = ByteTokenizer(config) if req.tokenizer is None else load_tokenizer(req.tokenizer, config)
        if req.env is None:
            fmt = PromptFormat(tok, req.chat)
        else:
            from k3core.rl.envs import load_env

            fmt = PromptFormat(tok, req.chat, load_env(req.env))
        table = shard_table(eng, fmt, list(req.prompts), req.bounds, req.params, req.iteration,
                            req.first_prompt_index, worker, req.prompt_ids, req.episode_limits, req.env)
        versions = set(table.column("weight_version").to_pylist())
        if versions - {req.version}:
            raise WeightVersionMismatch(f"rollout {req.iteration} shard {req.bounds} came back with weight versions "
                               f"{sorted(versions)}, expected {req.version} only")
        return table

    def versions(self) -> dict[str, int]:
        with self._lock:
            return {k: e.weight_version for k, e in self._engines.items()}
