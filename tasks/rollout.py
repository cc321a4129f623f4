"""Stage 4, rollout: sample completions at a given weight version through ``RolloutClient``: the
embedded engine (``rollout_url="local"``, the default) or a rollout server at a URL (``k3rl serve``,
or SGLang serving K3); per-token logprobs, routed expert ids and the weight version, written as Parquet.
A server that does not serve the version asked for is first pushed those weights from disk; a
rollout whose rows carry another version is refused, never written."""

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


def rollout_client(run_id: str, weights: dict, rollout_url: str = "local"):
    """A ``RolloutClient`` serving ``weights['version']``: the live embedded engine, or the server at
    ``rollout_url``, pushed the weights through ``/update_weights_from_disk`` when it serves another
    version (a trainer checkpoint is first written in the public layout, ``k3core.transfer.write_disk``)."""
    from k3core.rollout.client import RolloutClient

    if rollout_url in (None, "", "local"):
        return RolloutClient("local", engine=engine_for(run_id, weights))
    from k3core.config import K3Config

    config = K3Config.from_json_file(f"{weights['path']}/config.json")
    client = RolloutClient(rollout_url, config=config)
    if str(client.weight_version()) == str(weights["version"]):
        return client
    if weights["kind"] != "dcp":  # already a public-layout checkpoint
        client.update_weights_from_disk(weights["path"], weights["version"])
        return client
    import shutil
    import tempfile

    from k3core.rl.stages import load_trainer_state
    from k3core.transfer import write_disk

    model, _, _ = load_trainer_state(weights["path"], lr=0.0)
    tmp = tempfile.mkdtemp(prefix="k3rl-push-")
    try:
        write_disk(f"{tmp}/weights", model, model.config, weights["version"], weights.get("quantized", True))
        client.update_weights_from_disk(f"{tmp}/weights", weights["version"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return client


def rollout(run_id: str, iteration: int, weights: dict, env_spec: str, n_prompts: int, group_size: int,
            max_new_tokens: int, temperature: float, top_p: float, seed: int, artifact_root: str, rel: str,
            rollout_url: str = "local") -> dict:
    from k3core.config import K3Config
    from k3core.rl.data import training_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.stages import rollout_table
    from k3core.rollout.client import WeightVersionMismatch
    from k3core.rollout.engine import SamplingParams
    from k3core.tokenizer import ByteTokenizer

    store = ArtifactStore(artifact_root)
    t0 = time.perf_counter()
    if not store.exists(rel):
        client = rollout_client(run_id, weights, rollout_url)
        client.check_version(weights["version"])
        tok = ByteTokenizer(K3Config.from_json_file(f"{weights['path']}/config.json"))
        prompts = training_prompts(load_env(env_spec), seed, iteration, n_prompts, env_spec)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                stop_token_ids=(tok.eos_id,), n=group_size, seed=seed * 100003 + iteration)
        table = rollout_table(client, tok, prompts, params, iteration)  # the client has generate()'s signature
        versions = set(table.column("weight_version").to_pylist())
        if versions != {weights["version"]}:
            raise WeightVersionMismatch(f"rollout {iteration} came back with weight versions {sorted(versions)}, "
                                        f"expected {weights['version']} only (the weights changed mid-rollout)")
        with store.publish(rel) as tmp:
            pq.write_table(table, tmp)
    path = store.open_local(rel)
    table = pq.read_table(path)
    tokens = sum(len(x) for x in table.column("output_ids").to_pylist())
    dt = time.perf_counter() - t0
    get_run_logger().info(f"iteration {iteration}: {table.num_rows} samples, {tokens} tokens, weight version "
                          f"{weights['version']}, engine {rollout_url}")
    return {"uri": store.uri(rel), "path": str(path), "sha256": sha256_file(path), "rows": table.num_rows,
            "version": weights["version"], "tokens": tokens, "seconds": dt}
