"""Stage 1, fetch_checkpoint: a source (fsspec URL, or ``init:PRESET[:SEED]`` for a fresh seeded
checkpoint) -> a local public-layout checkpoint directory under the artifact root."""

from __future__ import annotations

from prefect import get_run_logger

from k3core.artifacts import ArtifactStore, sha256_tree


def fetch_checkpoint(source: str, artifact_root: str, rel: str) -> dict:
    log = get_run_logger()
    store = ArtifactStore(artifact_root)
    if not store.exists(rel):
        with store.publish(rel, is_dir=True) as tmp:
            if source.startswith("init:"):
                from k3core.checkpoint.hf import init_checkpoint

                _, preset, *rest = source.split(":")
                seed = int(rest[0]) if rest else 0
                log.info(f"creating a fresh '{preset}' checkpoint (seed {seed}) in the public HF layout")
                init_checkpoint(preset, tmp / "ckpt", seed=seed, format="bf16")
            else:
                from k3core.checkpoint.fetch import fetch

                log.info(f"fetching {source}")
                fetch(source, tmp / "ckpt")
    local = store.open_local(rel) / "ckpt"
    return {"uri": store.uri(rel), "path": str(local), "sha256": sha256_tree(local), "source": source}
