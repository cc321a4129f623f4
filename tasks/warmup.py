"""Supervised warm-up (optional first stage of RL): teach the answer format from the environment's
reference completions on training prompts, then publish the policy in the public bf16 layout."""

from __future__ import annotations

from prefect import get_run_logger

from k3core.artifacts import ArtifactStore, sha256_tree


def warmup(ckpt: dict, env_spec: str, steps: int, batch_size: int, lr: float, seed: int,
           artifact_root: str, rel: str) -> dict:
    from k3core.checkpoint.hf import save_hf
    from k3core.rl.envs import load_env
    from k3core.rl.stages import load_policy, supervised_warmup
    from k3core.tokenizer import ByteTokenizer

    log = get_run_logger()
    store = ArtifactStore(artifact_root)
    metrics: dict = {"warmup_steps": steps}
    if not store.exists(rel):
        model = load_policy(ckpt["path"])
        env = load_env(env_spec)
        metrics = supervised_warmup(model, env, env_spec, ByteTokenizer(model.config), steps, batch_size, lr, seed,
                                    log=log.info)
        with store.publish(rel, is_dir=True) as tmp:
            save_hf(model, tmp / "ckpt", model.config, target="bf16")
    local = store.open_local(rel) / "ckpt"
    return {"uri": store.uri(rel), "path": str(local), "sha256": sha256_tree(local), "kind": "hf", "version": 0,
            "metrics": metrics}
