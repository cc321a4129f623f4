"""Rollout and scored tables (Parquet schemas in ``k3core.rl.data``): completions to rows, rows to
rewards and GRPO advantages, rows to training sequences."""

from __future__ import annotations

import pyarrow as pa
import torch

from k3core.rl.data import ROLLOUT_SCHEMA, SCORED_SCHEMA
from k3core.rl.rewards import score_completions
from k3core.rl.sandbox import SandboxLimits
from k3core.rl.grpo import group_advantages, uniform_groups
from k3core.rollout.engine import RolloutEngine, SamplingParams
from k3core.rl.prompting import PromptFormat


def rollout_table(engine: RolloutEngine, fmt: PromptFormat, prompts: list[str], params: SamplingParams,
                  iteration: int, first_prompt_index: int = 0, *, shard_start: int = 0,
                  worker: str = "local", prompt_ids: list[list[int]] | None = None,
                  episode_limits=None, env_spec: str | None = None) -> pa.Table:
    """One row per completion; ``prompt_index`` counts from ``first_prompt_index`` (refill rounds of
    dynamic sampling number their prompts after the earlier rounds', so groups stay distinct).
    ``shard_start`` > 0: ``prompts`` are a rollout's prompts from that position on (a shard,
    ``k3core.rl.shards``): they get that rollout's seeds and prompt indices (``engine`` must be a
    ``RolloutEngine``). ``worker``: recorded in every row. ``fmt``: how prompts become ids and
    completions text (``k3core.rl.prompting``); ``prompt_ids``: the prompts' ids when the caller
    rendered them already (a shard on a worker without the environment). Rows keep the ids the
    engine saw and sampled; ``completion`` is their text, for rewards and display only. An agentic
    environment (``fmt.env`` with tools) gives one row per episode (``k3core.rl.episodes``), within
    ``episode_limits`` (an ``EpisodeLimits``), with its loss mask and turns; its tools run where
    ``tools_of(env, env_spec)`` says (``env_spec`` None: in this process)."""
    from k3core.rl.episodes import EpisodeLimits, is_agentic
    from k3core.rl.harness import is_harness

    if is_harness(fmt.env):
        return _harness_table(engine, fmt, prompts, params, iteration, first_prompt_index + shard_start, worker,
                              env_spec)
    if is_agentic(fmt.env):
        return _episode_table(engine, fmt, prompts, params, iteration, first_prompt_index + shard_start, worker,
                              episode_limits or EpisodeLimits(), env_spec)
    ids = [fmt.prompt_ids(p) for p in prompts] if prompt_ids is None else [list(x) for x in prompt_ids]
    if shard_start:
        comps = engine.generate(ids, params, pad_id=fmt.pad_id, first_index=shard_start)
    else:
        comps = engine.generate(ids, params, pad_id=fmt.pad_id)
    first_prompt_index += shard_start
    rows = {f.name: [] for f in ROLLOUT_SCHEMA}
    for c in comps:
        rows["iteration"].append(iteration)
        rows["prompt_index"].append(first_prompt_index + c.prompt_index)
        rows["sample_index"].append(c.sample_index)
        rows["prompt"].append(prompts[c.prompt_index])
        rows["prompt_ids"].append(c.prompt_ids)
        rows["output_ids"].append(c.output_ids)
        rows["completion"].append(fmt.completion_text(c.output_ids))
        rows["logprobs"].append(c.logprobs)
        rows["routing"].append(c.routing.reshape(-1).tolist())
        rows["finish_reason"].append(c.finish_reason)
        rows["weight_version"].append(c.weight_version)
        rows["worker"].append(worker)
        rows["loss_mask"].append(None)
        rows["turns"].append(None)
        rows["token_versions"].append(c.token_versions or [c.weight_version] * len(c.output_ids))
    return pa.table(rows, schema=ROLLOUT_SCHEMA)


def _episode_table(client, fmt: PromptFormat, prompts: list[str], params: SamplingParams, iteration: int,
                   first_prompt_index: int, worker: str, limits, env_spec: str | None) -> pa.Table:
    from k3core.rl.episodes import run_episodes, tools_of

    with tools_of(fmt.env, env_spec, limits) as (runner, workers):
        eps = run_episodes(client, fmt, fmt.env, prompts, params, max_turns=limits.max_turns,
                           max_tokens=limits.max_tokens, tool_runner=runner, tool_workers=workers,
                           first_index=first_prompt_index)
    return _trajectory_rows(eps, fmt, params, iteration, first_prompt_index, worker)


def _harness_table(client, fmt: PromptFormat, prompts: list[str], params: SamplingParams, iteration: int,
                   first_prompt_index: int, worker: str, env_spec: str | None) -> pa.Table:
    """The episodes of a harness environment (``k3core.rl.harness``) on ``client``'s engine."""
    from k3core.rl.harness import harness_episodes

    eps = harness_episodes(client, fmt.tok, fmt.env, prompts, params.n, temperature=params.temperature,
                           max_tokens=params.max_new_tokens, first_index=first_prompt_index, spec=env_spec or "?")
    return _trajectory_rows(eps, fmt, params, iteration, first_prompt_index, worker)


def _trajectory_rows(eps, fmt: PromptFormat, params: SamplingParams, iteration: int, first_prompt_index: int,
                     worker: str) -> pa.Table:
    import json

    rows = {f.name: [] for f in ROLLOUT_SCHEMA}
    for k, ep in enumerate(eps):
        values = dict(iteration=iteration, prompt_index=first_prompt_index + k // params.n, sample_index=ep.sample_index,
                      prompt=ep.prompt, prompt_ids=ep.prompt_ids, output_ids=ep.output_ids,
                      completion=fmt.tok.decode(ep.output_ids), logprobs=ep.logprobs,
                      routing=None if ep.routing is None else ep.routing.reshape(-1).tolist(),
                      finish_reason=ep.finish_reason, weight_version=ep.weight_version, worker=worker,
                      loss_mask=ep.loss_mask, turns=json.dumps(ep.turns), token_versions=ep.token_versions())
        for name, v in values.items():
            rows[name].append(v)
    return pa.table(rows, schema=ROLLOUT_SCHEMA)


def score_table(rollouts: pa.Table, env, env_spec: str, group_size: int,
                scale_advantages: bool = True, limits: SandboxLimits | None = None,
                outcomes: list | None = None) -> tuple[pa.Table, dict]:
    """Rewards (``k3core.rl.rewards``: checked finite and in [0, 1]; with ``limits``, user and dataset
    environments in the sandbox, a call it stopped scored 0 with its ``reward_reason``; None: in this
    process) and GRPO
    advantages: reward minus the group mean, divided by the group's std when ``scale_advantages``.
    Statistics: reward mean / std, solved fraction, mean completion length, ``groups`` and
    ``groups_informative`` (groups whose rewards differ), ``sandbox_stopped`` (calls the sandbox
    stopped). ``outcomes``: the rewards already computed (one ``RewardOutcome`` per row, in the
    table's order: reward fan-out, ``k3core.rl.rewards.merge_outcomes``) instead of computing them."""
    if rollouts.num_rows == 0:
        raise ValueError("no rollouts to score: the rollout table is empty")
    if outcomes is None:
        prompts, comps = rollouts.column("prompt").to_pylist(), rollouts.column("completion").to_pylist()
        outcomes = score_completions(env, env_spec, prompts, comps, limits)
    elif len(outcomes) != rollouts.num_rows:
        raise ValueError(f"{len(outcomes)} reward outcomes for {rollouts.num_rows} rollouts")
    rewards = torch.tensor([o.reward for o in outcomes])
    order = sorted(range(rollouts.num_rows), key=lambda i: (rollouts["prompt_index"][i].as_py(),
                                                            rollouts["sample_index"][i].as_py()))
    rollouts = rollouts.take(order)
    rewards = rewards[order]
    adv = group_advantages(rewards, group_size, scale=scale_advantages)
    table = rollouts.append_column("reward", pa.array(rewards.tolist(), pa.float32()))
    table = table.append_column("advantage", pa.array(adv.tolist(), pa.float32()))
    table = table.append_column("reward_reason", pa.array([outcomes[i].reason for i in order], pa.string()))
    table = table.cast(SCORED_SCHEMA)
    lens = [len(x) for x in table.column("output_ids").to_pylist()]
    uniform = uniform_groups(rewards, group_size)
    stats = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
             "response_length_mean": sum(lens) / len(lens),
             "solved_fraction": float((rewards == 1.0).float().mean()),
             "groups": int(uniform.numel()), "groups_informative": int((~uniform).sum()),
             "sandbox_stopped": sum(o.stopped for o in outcomes)}
    if "turns" in table.column_names:  # an agentic rollout: its tool-use metrics
        from k3core.rl.episodes import episode_stats

        stats.update(episode_stats(table.column("turns").to_pylist(), table.column("loss_mask").to_pylist(),
                                   table.column("finish_reason").to_pylist()))
    return table, stats
