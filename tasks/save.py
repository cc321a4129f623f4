"""Stage 8, save_checkpoint: commit a trained state as the run's checkpoint for that iteration: the
files (hard-linked where possible), a manifest of their sha256, then the ``latest`` pointer, last."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from k3core.artifacts import ArtifactStore, sha256_file


def save_checkpoint(trained: dict, run_id: str, iteration: int, artifact_root: str, rel: str, latest_rel: str) -> dict:
    store = ArtifactStore(artifact_root)
    src = Path(trained["path"])
    if not store.exists(rel):
        with store.publish(rel, is_dir=True) as tmp:
            files = {}
            for p in sorted(x for x in src.rglob("*") if x.is_file()):
                dst = tmp / "state" / p.relative_to(src)
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(p, dst)
                except OSError:
                    shutil.copy2(p, dst)
                files[str(p.relative_to(src))] = sha256_file(dst)
            manifest = {"run_id": run_id, "iteration": iteration, "version": trained["version"],
                        "trained_from": trained["uri"], "files": files}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    local = store.open_local(rel)
    pointer = {"run_id": run_id, "iteration": iteration, "checkpoint": store.uri(rel), "version": trained["version"]}
    store.replace_text(latest_rel, json.dumps(pointer, indent=2))  # last: a crash before this keeps the old latest
    return {"uri": store.uri(rel), "path": str(local / "state"), "kind": "dcp", "version": trained["version"],
            "manifest": store.uri(f"{rel}/manifest.json"), "sha256": sha256_file(local / "manifest.json")}
