"""Held-out evaluation at one weight version: sampled (the RL objective) and greedy reward on
prompts training never sees."""

from __future__ import annotations


def evaluate(run_id: str, weights: dict, env_spec: str, n_prompts: int, max_new_tokens: int, seed: int,
             temperature: float = 1.0) -> dict:
    from k3core.rl.data import heldout_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.stages import evaluate as run_eval
    from k3core.tokenizer import ByteTokenizer
    from tasks.rollout import engine_for

    eng = engine_for(run_id, weights)
    env = load_env(env_spec)
    prompts = heldout_prompts(env, seed, n_prompts, env_spec)
    out = run_eval(eng, ByteTokenizer(eng.config), env, env_spec, prompts, max_new_tokens, temperature, seed=seed)
    out["version"] = weights["version"]
    return out
