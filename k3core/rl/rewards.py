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
"""

from __future__ import annotations

from k3core.rl.envs import BUILTIN_ENVS, RewardError, checked_reward
from k3core.rl.sandbox import RewardOutcome, RewardSandbox, SandboxLimits

__all__ = ["RewardOutcome", "in_process", "score_completions"]

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
