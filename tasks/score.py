"""score_rewards: the environment's exact rewards and GRPO advantages (group mean subtracted, divided
by the group's std unless ``scale_advantages`` is off), written as Parquet. User and dataset
environments score in the reward sandbox (``k3core.rl.sandbox``): a call it stops (timeout, memory,
processes, filesystem, network) scores 0 with the reason in the ``reward_reason`` column, and the
stage completes. A reward that is NaN, out of [0, 1], raises or exits fails the stage (not retried).

Fan-out (``--task-runner dask|ray``, ``score_fanout``): a sandboxed environment's reward calls are cut
into ``--rollout-workers`` contiguous shards of the rollout table's rows, each a ``score_shard`` task
on the flow's task runner (a worker process with its own sandbox), published as
``iter-N/score-shards/shard-K-of-N.parquet``; ``score_rewards`` then takes the outcomes from those
files in row order (``k3core.rl.rewards.merge_outcomes``) instead of calling the sandbox: the same
scored table as local scoring. Built-in environments score in process, where a call costs less than
sending it to a worker, and are never fanned out."""

from __future__ import annotations

import pyarrow.parquet as pq

from k3core.artifacts import Artifact
from k3core.rl.sandbox import SandboxLimits
from k3core.settings import GRPOSettings, RewardSettings
from tasks.common import Run, read_table, round_run_name, stage


def _rel(run: Run, iteration: int, refill: int = 0) -> str:
    return run.iter_rel(iteration, f"scored-refill{refill}.parquet" if refill else "scored.parquet")


@stage(run_name=round_run_name("score_rewards"), key="score",
       outputs=lambda run, iteration, refill, **_: [run.uri(_rel(run, iteration, refill))],
       inputs=lambda rollouts, reward_shards=(), **_: [rollouts.uri, *(a.uri for a in reward_shards)])
def score_rewards(run: Run, iteration: int, rollouts: Artifact, settings: GRPOSettings,
                  reward: RewardSettings = RewardSettings(), refill: int = 0,
                  reward_shards: tuple[Artifact, ...] = ()) -> Artifact:
    """The handle's info has the reward statistics and ``groups`` / ``groups_informative`` (groups
    whose rewards differ: what dynamic sampling counts). A group is the ``group_size`` samples of
    one prompt that the rollouts' handle records; ``settings.scale_advantages`` divides by the
    group's std. ``refill`` > 0: the rollouts of that dynamic-sampling round (task run
    ``score_rewards-iterN-refillR``). ``reward_shards``: the ``score_shard`` outputs that hold every
    row's reward (fan-out); empty: the rewards are computed here."""
    from k3core.rl.envs import load_env
    from k3core.rl.rewards import merge_outcomes
    from k3core.rl.tables import score_table

    rows = read_table(rollouts)
    outcomes = merge_outcomes([pq.read_table(a.path) for a in reward_shards], rows.num_rows) if reward_shards else None
    table, stats = score_table(rows, load_env(run.env), run.env, rollouts.info["group_size"],
                               scale_advantages=settings.scale_advantages, limits=SandboxLimits.of(reward),
                               outcomes=outcomes)
    run.store.publish_once(_rel(run, iteration, refill), lambda tmp: pq.write_table(table, tmp))
    if "episode_turns" in stats:
        _publish_trajectories(run, iteration, refill, table, stats)
    return run.store.handle(_rel(run, iteration, refill), "scored", version=rollouts.version, **stats)


def _publish_trajectories(run: Run, iteration: int, refill: int, table, stats: dict) -> None:
    """The trajectory viewer of an agentic rollout: a markdown artifact of a few scored episodes on
    this task run (key ``rl-trajectories-<run id>``: each iteration a new version of it)."""
    import re

    from prefect.artifacts import create_markdown_artifact

    from k3core.rl.episodes import trajectories_markdown

    title = (f"run `{run.run_id}` iteration {iteration}{f' refill {refill}' if refill else ''}: episodes "
             f"({stats['episode_turns']:.2f} turns, {stats['tool_calls_per_episode']:.2f} tool calls, tool error rate "
             f"{stats['tool_error_rate']:.2f} per episode)")
    create_markdown_artifact(trajectories_markdown(table.to_pylist(), title),
                             key="rl-trajectories-" + re.sub(r"[^a-z0-9-]", "-", run.run_id.lower()),
                             description=f"run {run.run_id}: episodes of iteration {iteration}")


# ---- fan-out of sandboxed reward calls over the task runner's workers --------------------------------------

def _shard_rel(run: Run, iteration: int, refill: int, shard: tuple[int, int]) -> str:
    folder = f"score-shards-refill{refill}" if refill else "score-shards"
    return run.iter_rel(iteration, f"{folder}/shard-{shard[0]}-of-{shard[1]}.parquet")


@stage(run_name=lambda iteration, shard, **_: f"score_rewards-iter{iteration}-shard{shard[0]}-of-{shard[1]}",
       outputs=lambda run, iteration, refill, shard, **_: [run.uri(_shard_rel(run, iteration, refill, shard))],
       inputs=lambda rollouts, **_: [rollouts.uri])
def score_shard(run: Run, iteration: int, rollouts: Artifact, reward: RewardSettings, shard: tuple[int, int],
                refill: int = 0) -> Artifact:
    """The reward outcomes of shard ``shard`` = (k, n), the k-th of n, of the rollout table's rows
    (contiguous, ``k3core.rl.shards.shard_bounds``), scored in a sandbox of this worker process."""
    from k3core.rl.envs import load_env
    from k3core.rl.rewards import outcome_table, score_completions
    from k3core.rl.shards import shard_bounds

    rel = _shard_rel(run, iteration, refill, shard)

    def build(tmp):
        table = read_table(rollouts, columns=["prompt", "completion"])
        start, stop = shard_bounds(table.num_rows, shard[1])[shard[0]]
        part = table.slice(start, stop - start)
        outcomes = score_completions(load_env(run.env), run.env, part.column("prompt").to_pylist(),
                                     part.column("completion").to_pylist(), SandboxLimits.of(reward))
        pq.write_table(outcome_table(outcomes, start), tmp)

    path = run.store.publish_once(rel, build)
    return run.store.handle(rel, "reward-shard", version=rollouts.version, rows=pq.read_metadata(path).num_rows)


def fans_out(run: Run) -> bool:
    """Whether this run's rewards are worth spreading over workers: sandboxed environments only."""
    from k3core.rl.rewards import in_process

    return not in_process(run.env, SandboxLimits())


def score_fanout(run: Run, iteration: int, rollouts: Artifact, settings: GRPOSettings, reward: RewardSettings,
                 shards: int, refill: int = 0) -> Artifact:
    """``score_rewards`` with its reward calls as ``shards`` ``score_shard`` tasks on the flow's task
    runner. Call it from a flow body."""
    import time

    from tasks.common import record_seconds

    t0 = time.perf_counter()
    futures = [score_shard.submit(run, iteration, rollouts, reward, (k, shards), refill) for k in range(shards)]
    parts = tuple(f.result() for f in futures)
    record_seconds("score", time.perf_counter() - t0)  # the merge adds its own time under the same key
    return score_rewards(run, iteration, rollouts, settings, reward, refill, parts)
