"""Stage 4, rollout: sample completions with the embedded engine at a given weight version; per-token
logprobs, routed expert ids and the weight version, written as Parquet."""

from __future__ import annotations

import time

import pyarrow.parquet as pq
from prefect import get_run_logger

from k3core.artifacts import ArtifactStore, sha256_file
from tasks import engines


def engine_for(run_id: str, weights: dict):
    """The live engine at ``weights['version']``, or a new one built from the durable artifact.
    Quantised weights run on the W4A8 engine (MXFP4 routed experts, FP8 activations)."""
    from k3core.rl.stages import build_engine, engine_from_model, load_trainer_state

    eng = engines.get(run_id)
    if eng is not None and eng.weight_version == weights["version"]:
        return eng
    if weights["kind"] == "dcp":  # a trainer checkpoint: quantise routed experts on the way
        model, _, _ = load_trainer_state(weights["path"], lr=0.0)
        eng = engine_from_model(model, weights["version"], quantized=weights.get("quantized", True))
    else:
        eng = build_engine(weights["path"], weights["version"])
    engines.put(run_id, eng)
    return eng


def rollout(run_id: str, iteration: int, weights: dict, env_spec: str, n_prompts: int, group_size: int,
            max_new_tokens: int, temperature: float, top_p: float, seed: int, artifact_root: str, rel: str) -> dict:
    from k3core.rl.data import training_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.stages import rollout_table
    from k3core.rollout.engine import SamplingParams
    from k3core.tokenizer import ByteTokenizer

    store = ArtifactStore(artifact_root)
    t0 = time.perf_counter()
    if not store.exists(rel):
        eng = engine_for(run_id, weights)
        tok = ByteTokenizer(eng.config)
        prompts = training_prompts(load_env(env_spec), seed, iteration, n_prompts, env_spec)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                stop_token_ids=(tok.eos_id,), n=group_size, seed=seed * 100003 + iteration)
        table = rollout_table(eng, tok, prompts, params, iteration)
        with store.publish(rel) as tmp:
            pq.write_table(table, tmp)
    path = store.open_local(rel)
    table = pq.read_table(path)
    tokens = sum(len(x) for x in table.column("output_ids").to_pylist())
    dt = time.perf_counter() - t0
    get_run_logger().info(f"iteration {iteration}: {table.num_rows} samples, {tokens} tokens, weight version {weights['version']}")
    return {"uri": store.uri(rel), "path": str(path), "sha256": sha256_file(path), "rows": table.num_rows,
            "version": weights["version"], "tokens": tokens, "seconds": dt}
