"""Prompt streams and the rollout / score tables (Parquet schemas).

Prompts are split once, by a stable hash of their text, into a training stream and a held-out
stream (1 in ``HELDOUT_MOD``): held-out reward is measured on prompts training never sees. Each
iteration's prompts come from an RNG seeded by (seed, iteration) (and the refill round, for dynamic
sampling). A dataset environment is a stream instead, read at a position (the data cursor) that each
trainer state records and a resume restores (``k3core.rl.dataset_env``).
"""

from __future__ import annotations

import random

import pyarrow as pa

from k3core.rl.envs import checked_prompts
from k3core.rl.heldout import HELDOUT_MOD, is_heldout  # noqa: F401  (re-exported: the data stream's split)


ROLLOUT_SCHEMA = pa.schema([
    ("iteration", pa.int32()),
    ("prompt_index", pa.int32()),
    ("sample_index", pa.int32()),
    ("prompt", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("output_ids", pa.list_(pa.int32())),
    ("completion", pa.string()),
    ("logprobs", pa.list_(pa.float32())),
    ("routing", pa.list_(pa.int16())),  # [positions, n_moe, k] flattened, prompt positions first
    ("finish_reason", pa.string()),
    ("weight_version", pa.int64()),
    ("worker", pa.string()),  # what generated the row: "local", or the Dask worker of its rollout shard
    # agentic episodes (k3core.rl.episodes): 1 on sampled output tokens, 0 on tool results and user turns
    # (null: every output token was sampled); the turns as JSON (role, token span, tool, arguments, result, ...)
    ("loss_mask", pa.list_(pa.int8())),
    ("turns", pa.string()),
    # per output token, the weight version that sampled it (null where the environment wrote): what a
    # correction needs once versions can change within a trajectory
    ("token_versions", pa.list_(pa.int64())),
])

SCORED_SCHEMA = pa.schema(list(ROLLOUT_SCHEMA) + [
    ("reward", pa.float32()),
    ("advantage", pa.float32()),
    ("reward_reason", pa.string()),  # why the sandbox set the reward (timeout, memory, ...); '' otherwise
])


# The frozen reference policy's log-probability of each generated token of a batch (KL penalty).
REF_LOGPROBS_SCHEMA = pa.schema([
    ("prompt_index", pa.int32()),
    ("sample_index", pa.int32()),
    ("ref_logprobs", pa.list_(pa.float32())),
])


def _draw(env, rng: random.Random, n: int, want_heldout: bool, spec: str, max_tries: int = 200) -> list[str]:
    out: list[str] = []
    for _ in range(max_tries):
        out += [p for p in checked_prompts(env, rng, max(n, 8), spec) if is_heldout(p) == want_heldout]
        if len(out) >= n:
            return out[:n]
    kind = "held-out" if want_heldout else "training"
    raise ValueError(f"environment {spec!r} produced too few distinct {kind} prompts ({len(out)} of {n}); "
                     f"its prompt space may be too small for a held-out split")


def training_prompts(env, seed: int, iteration: int, n: int, spec: str = "?", refill: int = 0,
                     position: int | None = None) -> list[str]:
    """The ``n`` training prompts of ``iteration``; ``refill`` > 0: the prompts of that dynamic-sampling
    refill round of the iteration (a stream of its own: the first round is the same with or without
    refills). An environment with a stream of its own (``prompts_at(seed, position, n)``: a dataset)
    is read at ``position`` instead, the data cursor the caller restores from the trainer state."""
    if position is not None and callable(getattr(env, "prompts_at", None)):
        return env.prompts_at(seed, position, n)
    key = f"train:{seed}:{iteration}" + (f":refill{refill}" if refill else "")
    return _draw(env, random.Random(key), n, False, spec)


def heldout_prompts(env, seed: int, n: int, spec: str = "?") -> list[str]:
    """``n`` held-out prompts; a dataset gives its held-out rows (``heldout_prompts(n)``)."""
    if callable(getattr(env, "heldout_prompts", None)):
        return env.heldout_prompts(n)
    return _draw(env, random.Random(f"heldout:{seed}"), n, True, spec)
