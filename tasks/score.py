"""score_rewards: the environment's exact rewards and GRPO advantages (group mean subtracted, divided
by the group's std unless ``scale_advantages`` is off), written as Parquet. A reward that is NaN, out
of [0, 1] or raises fails the stage (not retried)."""

from __future__ import annotations

import pyarrow.parquet as pq

from k3core.artifacts import Artifact
from tasks.common import Run, stage


def _rel(run: Run, iteration: int) -> str:
    return run.iter_rel(iteration, "scored.parquet")


@stage(run_name="score_rewards-iter{iteration}", key="score",
       outputs=lambda run, iteration, **_: [run.uri(_rel(run, iteration))], inputs=lambda rollouts, **_: [rollouts.uri])
def score_rewards(run: Run, iteration: int, rollouts: Artifact, group_size: int,
                  scale_advantages: bool = True) -> Artifact:
    from k3core.rl.envs import load_env
    from k3core.rl.tables import score_table

    table, stats = score_table(pq.read_table(rollouts.path), load_env(run.env), run.env, group_size,
                               scale_advantages=scale_advantages)
    run.store.publish_once(_rel(run, iteration), lambda tmp: pq.write_table(table, tmp))
    return run.store.handle(_rel(run, iteration), "scored", version=rollouts.version, **stats)
