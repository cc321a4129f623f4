"""Rewards of many completions, and where they are computed: the built-in environments (``add``,
``reverse``: our code, pure string arithmetic) in this process; every other environment (a user's
``module.path:factory``, a dataset environment with its verifier) in the reward sandbox
(``k3core.rl.sandbox``), one confined process per call, whenever the caller gives the sandbox's
limits. The pipeline's stages always do. A caller holding an environment object that no spec can
load (a notebook, ``k3core.rl.loop``) passes ``limits=None`` and its rewards run in its own process.

Owns the routing and the failure policy: a call the sandbox stopped (timeout, memory, processes,
filesystem, network) is reward 0 with its reason; a broken reward function (raises, exits, NaN, out of
[0, 1]) is a ``RewardError`` naming the environment, the prompt and the completion, which fails the
stage once (it is a ``ValueError``, so stages do not retry it). Does not own the environments
(``k3core.rl.envs``) or the confinement (``k3core.rl.sandbox``).

Fan-out (the pipeline's ``--task-runner dask|ray``): a rollout's rewards may be computed in
contiguous shards of its rows on different worker processes, each with a sandbox of its own
(``score_completions`` over its rows, then ``outcome_table``); ``merge_outcomes`` puts them back in
row order. Every call is a function of its (prompt, completion) alone, run in a fresh process, so
the merged outcomes are the ones one call over all rows gives.
"""

from __future__ import annotations

import pyarrow as pa

from k3core.rl.envs import BUILTIN_ENVS, RewardError, checked_reward
from k3core.rl.sandbox import RewardOutcome, RewardSandbox, SandboxLimits

__all__ = ["OUTCOME_SCHEMA", "RewardOutcome", "in_process", "merge_outcomes", "outcome_table", "score_completions"]

# One shard's outcomes: ``position`` is the row of the scored table (its order as read), reward as a
# float64 so that it round-trips exactly.
OUTCOME_SCHEMA = pa.schema([("position", pa.int64()), ("reward", pa.float64()), ("reason", pa.string()),
                            ("stopped", pa.bool_())])

IN_PROCESS = frozenset(BUILTIN_ENVS)


def in_process(spec: str, limits: SandboxLimits | None) -> bool:
    """Whether ``spec``'s rewards are computed in this process rather than sandboxed."""
    return spec in IN_PROCESS or limits is None


def score_completions(env, spec: str, prompts: list[str], completions: list[str],
                      limits: SandboxLimits | None) -> list[RewardOutcome]:
    """One ``RewardOutcome`` per (prompt, completion). ``limits``: the sandbox's, which then loads the
    environment by ``spec`` in its workers (``env`` is not used); None: ``env.reward`` in this process."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if in_process(spec, limits):
        return [RewardOutcome(checked_reward(env, p, c, spec)) for p, c in zip(prompts, completions)]
    if not prompts:
        return []
    with RewardSandbox(spec, limits) as sandbox:
        outcomes = sandbox.score(prompts, completions)
    for p, c, o in zip(prompts, completions, outcomes):
        if o.broken:
            raise RewardError(f"environment {spec!r}: the reward function {o.broken} for prompt {p!r} "
                              f"completion {c!r} (a bug in the reward function: fix it, then run the same command)")
    return outcomes


def outcome_table(outcomes: list[RewardOutcome], start: int) -> pa.Table:
    """The outcomes of rows ``start, start + 1, ...`` as a table (``OUTCOME_SCHEMA``). A broken call
    never gets here: ``score_completions`` raised ``RewardError`` for it."""
    return pa.table({"position": list(range(start, start + len(outcomes))), "reward": [o.reward for o in outcomes],
                     "reason": [o.reason for o in outcomes], "stopped": [o.stopped for o in outcomes]},
                    schema=OUTCOME_SCHEMA)


def merge_outcomes(tables: list[pa.Table], rows: int) -> list[RewardOutcome]:
    """The outcomes of shard tables (any arrival order) in row order: every position in
    ``range(rows)`` exactly once, or ``ValueError`` naming what is missing or doubled."""
    table = pa.concat_tables([t.cast(OUTCOME_SCHEMA) for t in tables]) if tables else OUTCOME_SCHEMA.empty_table()
    positions = table.column("position").to_pylist()
    if len(positions) != len(set(positions)) or set(positions) != set(range(rows)):
        missing = sorted(set(range(rows)) - set(positions))
        raise ValueError(f"reward shards do not cover the {rows} rows: {len(missing)} missing (first {missing[:3]}), "
                         f"{len(positions) - len(set(positions))} doubled")
    order = sorted(range(len(positions)), key=positions.__getitem__)
    cols = {c: table.column(c).to_pylist() for c in ("reward", "reason", "stopped")}
    return [RewardOutcome(cols["reward"][i], cols["reason"][i], cols["stopped"][i]) for i in order]
