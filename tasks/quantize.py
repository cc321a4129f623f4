"""Stage 3, quantize_mxfp4: routed-expert weights to MXFP4 in the release layout (the rollout
engine's weights); everything else stays bf16/fp32 as the release declares."""

from __future__ import annotations

from k3core.artifacts import ArtifactStore, sha256_tree


def quantize_mxfp4(policy: dict, artifact_root: str, rel: str) -> dict:
    from k3core.checkpoint.hf import save_hf
    from k3core.rl.stages import load_policy

    store = ArtifactStore(artifact_root)
    if not store.exists(rel):
        model = load_policy(policy["path"])
        with store.publish(rel, is_dir=True) as tmp:
            save_hf(model, tmp / "ckpt", model.config, target="mxfp4")
    local = store.open_local(rel) / "ckpt"
    return {"uri": store.uri(rel), "path": str(local), "sha256": sha256_tree(local), "kind": "hf-mxfp4",
            "version": policy.get("version", 0)}
