"""evaluate: held-out evaluation at one weight version, sampled (the RL objective) and greedy reward
on prompts training never sees. Generation goes through ``RolloutClient``, as the rollout stage's:
the embedded engine (``url="local"``) or the rollout server at a URL, pushed the weights when it
serves another version; every completion must carry ``weights.version`` or the evaluation is
refused (``WeightVersionMismatch``)."""

from __future__ import annotations

from k3core.artifacts import Artifact
from k3core.rl.episodes import EpisodeLimits
from k3core.rl.sandbox import SandboxLimits
from k3core.settings import RewardSettings, RolloutSettings
from tasks.common import Run, stage


@stage(run_name="evaluate-{label}", inputs=lambda run, weights, **_: [run.served_uri(weights)])
def evaluate(run: Run, label: str, weights: Artifact, n_prompts: int, rollout: RolloutSettings,
             reward: RewardSettings = RewardSettings()) -> dict:
    """``label``: names the task run (``iter5``, ``final``); ``rollout``: the engine URL, the
    completion length and the sampling temperature of the run's rollouts; ``reward``: the sandbox's
    limits (user and dataset environments). The embedded engine runs on the run's device; its
    decode state is released afterwards (the train step may need the memory)."""
    from k3core.rl.data import heldout_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.evaluate import evaluate as run_eval
    from tasks.rollout import release_decode_state, rollout_client

    client = rollout_client(run, weights, rollout.url)
    client.routing = False  # rewards need tokens only (a real SGLang returns routing only when enabled)
    fmt = run.prompts(run.model_config(weights), weights.path)
    env = load_env(run.env)
    prompts = heldout_prompts(env, run.seed, n_prompts, run.env)
    out = run_eval(client, fmt, env, run.env, prompts, rollout.max_new_tokens, rollout.temperature, seed=run.seed,
                   expected_version=weights.version, limits=SandboxLimits.of(reward),
                   episode_limits=EpisodeLimits.of(rollout))
    out["version"] = weights.version
    release_decode_state(run.run_id)
    return out
