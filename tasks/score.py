"""Stage 5, score_rewards: the environment's exact rewards and GRPO group-normalised advantages,
written as Parquet. A reward that is NaN, out of [0, 1] or raises fails the stage (not retried)."""

from __future__ import annotations

import pyarrow.parquet as pq

from k3core.artifacts import ArtifactStore, sha256_file


def score_rewards(rollouts: dict, env_spec: str, group_size: int, artifact_root: str, rel: str) -> dict:
    from k3core.rl.envs import load_env
    from k3core.rl.stages import score_table

    store = ArtifactStore(artifact_root)
    table, stats = score_table(pq.read_table(rollouts["path"]), load_env(env_spec), env_spec, group_size)
    if not store.exists(rel):
        with store.publish(rel) as tmp:
            pq.write_table(table, tmp)
    path = store.open_local(rel)
    return {"uri": store.uri(rel), "path": str(path), "sha256": sha256_file(path), "stats": stats}
