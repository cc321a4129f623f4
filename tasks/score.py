"""score_rewards: the environment's exact rewards and GRPO advantages (group mean subtracted, divided
by the group's std unless ``scale_advantages`` is off), written as Parquet. User and dataset
environments score in the reward sandbox (``k3core.rl.sandbox``): a call it stops (timeout, memory,
processes, filesystem, network) scores 0 with the reason in the ``reward_reason`` column, and the
stage completes. A reward that is NaN, out of [0, 1], raises or exits fails the stage (not retried)."""

from __future__ import annotations

import pyarrow.parquet as pq

from k3core.artifacts import Artifact
from k3core.rl.sandbox import SandboxLimits
from k3core.settings import RewardSettings
from tasks.common import Run, stage


def _rel(run: Run, iteration: int, refill: int = 0) -> str:
    return run.iter_rel(iteration, f"scored-refill{refill}.parquet" if refill else "scored.parquet")


@stage(run_name="score_rewards-iter{iteration}", key="score",
       outputs=lambda run, iteration, refill, **_: [run.uri(_rel(run, iteration, refill))],
       inputs=lambda rollouts, **_: [rollouts.uri])
def score_rewards(run: Run, iteration: int, rollouts: Artifact, group_size: int, scale_advantages: bool = True,
                  refill: int = 0, reward: RewardSettings = RewardSettings()) -> Artifact:
    """The handle's info has the reward statistics and ``groups`` / ``groups_informative`` (groups
    whose rewards differ: what dynamic sampling counts). ``refill`` > 0 (``score_refill``): the
    rollouts of that refill round."""
    from k3core.rl.envs import load_env
    from k3core.rl.tables import score_table

    table, stats = score_table(pq.read_table(rollouts.path), load_env(run.env), run.env, group_size,
                               scale_advantages=scale_advantages, limits=SandboxLimits.of(reward))
    run.store.publish_once(_rel(run, iteration, refill), lambda tmp: pq.write_table(table, tmp))
    return run.store.handle(_rel(run, iteration, refill), "scored", version=rollouts.version, **stats)


# The same stage body for a dynamic-sampling refill round, under a task run name that says which.
score_refill = stage(run_name="score_rewards-iter{iteration}-refill{refill}", key="score",
                     outputs=lambda run, iteration, refill, **_: [run.uri(_rel(run, iteration, refill))],
                     inputs=lambda rollouts, **_: [rollouts.uri])(score_rewards.fn)
