"""Held-out evaluation of a policy through a rollout client (the embedded engine or a server)."""

from __future__ import annotations

import torch

from k3core.rl.rewards import score_completions
from k3core.rl.sandbox import SandboxLimits
from k3core.rollout.engine import RolloutEngine, SamplingParams
from k3core.rl.episodes import EpisodeLimits, is_agentic
from k3core.rl.harness import is_harness
from k3core.rl.prompting import PromptFormat


@torch.no_grad()
def evaluate(client, fmt: PromptFormat, env, env_spec: str, prompts: list[str], max_new_tokens: int,
             temperature: float = 1.0, samples: int = 4, seed: int = 0, expected_version=None,
             limits: SandboxLimits | None = None, episode_limits: EpisodeLimits = EpisodeLimits()) -> dict:
    """Held-out prompts (never trained on), two ways:
    - ``heldout_reward``: the policy's expected reward, the quantity RL maximises: ``samples``
      completions per prompt at the rollout temperature (fixed seed, so versions compare fairly);
    - ``heldout_greedy_reward``: greedy decoding (the policy's mode).
    ``client``: a ``RolloutClient`` (the local engine or a server URL: same seeds, same samples) or a
    ``RolloutEngine``; ``expected_version``: refuse (``WeightVersionMismatch``) an engine serving, or
    a completion produced by, any other weight version. Rewards as in scoring (``k3core.rl.rewards``:
    with ``limits``, user and dataset environments in the sandbox; None: in this process). ``fmt``:
    how prompts become ids and completions text (``k3core.rl.prompting``). An agentic environment
    runs whole episodes (``k3core.rl.episodes``, within ``episode_limits``; with ``limits`` its tools
    run where ``tools_of`` says, else in this process); a harness environment's agent loop runs
    against the engine (``k3core.rl.harness``), at the rollout temperature and then at 0."""
    from k3core.rollout.client import RolloutClient, WeightVersionMismatch

    if isinstance(client, RolloutEngine):
        client = RolloutClient("local", engine=client)

    def score(comps):
        outcomes = score_completions(env, env_spec, [prompts[c.prompt_index] for c in comps],
                                     [fmt.completion_text(c.output_ids) for c in comps], limits)
        return [o.reward for o in outcomes]

    def generate(params):
        return client.generate(ids, params, pad_id=fmt.pad_id, expected_version=expected_version)

    stop = fmt.stop_ids
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop, n=samples,
                              seed=seed)
    greedy_params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop)
    if is_harness(env):  # the user's agent loop against the engine, sampled then greedy
        from k3core.rl.harness import harness_episodes

        if expected_version is not None:
            client.check_version(expected_version)
        eps = [e for n, t in ((samples, temperature), (1, 0.0))
               for e in harness_episodes(client, fmt.tok, env, prompts, n, temperature=t, max_tokens=max_new_tokens,
                                         spec=env_spec or "?")]
        bad = {e.weight_version for e in eps} - {expected_version} if expected_version is not None else set()
        if bad:
            raise WeightVersionMismatch(f"held-out episodes came back with weight versions {sorted(bad, key=str)}, "
                                        f"expected {expected_version}")
        outcomes = score_completions(env, env_spec, [e.prompt for e in eps],
                                     [fmt.tok.decode(e.output_ids) for e in eps], limits)
        rewards = [o.reward for o in outcomes]
        n = len(prompts) * samples
        return _summary(rewards[:n], rewards[n:])
    if is_agentic(env):  # whole episodes, scored on their trajectories' text
        from k3core.rl.episodes import run_episodes, tools_of

        with tools_of(env, env_spec if limits is not None else None, episode_limits) as (runner, workers):
            eps = [e for params in (sampling, greedy_params)
                   for e in run_episodes(_Versioned(client, expected_version), fmt, env, prompts, params,
                                         max_turns=episode_limits.max_turns, max_tokens=episode_limits.max_tokens,
                                         tool_runner=runner, tool_workers=workers)]
        outcomes = score_completions(env, env_spec, [e.prompt for e in eps],
                                     [fmt.tok.decode(e.output_ids) for e in eps], limits)
        rewards = [o.reward for o in outcomes]
        n = len(prompts) * samples
        return _summary(rewards[:n], rewards[n:])
    ids = [fmt.prompt_ids(p) for p in prompts]
    sampled = generate(sampling)
    greedy = generate(greedy_params)
    rewards = score(sampled + greedy)  # one scoring pass: a sandbox starts its workers once
    return _summary(rewards[:len(sampled)], rewards[len(sampled):])


class _Versioned:
    """A client whose every generate call refuses a weight version other than ``expected``."""

    def __init__(self, client, expected):
        self.client, self.expected = client, expected

    def generate(self, prompts, params, sessions=None, **_):
        return self.client.generate(prompts, params, expected_version=self.expected, sessions=sessions)

    def release_sessions(self, sessions):
        return self.client.release_sessions(sessions)

    def driving(self):
        return self.client.driving()


def _summary(sampled: list[float], greedy: list[float]) -> dict:
    return {"heldout_reward": sum(sampled) / len(sampled),
            "heldout_solved": sum(r == 1.0 for r in sampled) / len(sampled),
            "heldout_greedy_reward": sum(greedy) / len(greedy),
            "heldout_greedy_solved": sum(r == 1.0 for r in greedy) / len(greedy), "heldout_n": len(sampled)}
