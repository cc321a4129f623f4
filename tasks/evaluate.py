"""Held-out evaluation at one weight version: sampled (the RL objective) and greedy reward on
prompts training never sees. Generation goes through ``RolloutClient``, as the rollout stage's: the
embedded engine (``rollout_url="local"``) or the rollout server at a URL, pushed the weights when it
serves another version; every completion must carry ``weights['version']`` or the evaluation is
refused (``WeightVersionMismatch``)."""

from __future__ import annotations


def evaluate(run_id: str, weights: dict, env_spec: str, n_prompts: int, max_new_tokens: int, seed: int,
             temperature: float = 1.0, rollout_url: str = "local") -> dict:
    from k3core.config import K3Config
    from k3core.rl.data import heldout_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.stages import evaluate as run_eval
    from k3core.tokenizer import ByteTokenizer
    from tasks.rollout import rollout_client

    client = rollout_client(run_id, weights, rollout_url)
    client.routing = False  # rewards need tokens only (a real SGLang returns routing only when enabled)
    tok = ByteTokenizer(K3Config.from_json_file(f"{weights['path']}/config.json"))
    env = load_env(env_spec)
    prompts = heldout_prompts(env, seed, n_prompts, env_spec)
    out = run_eval(client, tok, env, env_spec, prompts, max_new_tokens, temperature, seed=seed,
                   expected_version=weights["version"])
    out["version"] = weights["version"]
    return out
