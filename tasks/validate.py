"""Stage 2, validate_checkpoint: fail-closed structure and hash audit; a JSON report published only
when everything passes (a failure raises and is not retried)."""

from __future__ import annotations

import json

from prefect import get_run_logger

from k3core.artifacts import ArtifactStore


def validate_checkpoint(ckpt: dict, artifact_root: str, rel: str, preset: str | None = None) -> dict:
    from k3core.checkpoint.validate import validate_checkpoint as validate
    from k3core.config import K3Config

    store = ArtifactStore(artifact_root)
    config = K3Config.preset(preset) if preset else None
    report = validate(ckpt["path"], config=config)
    report = report if isinstance(report, dict) else report.to_dict()
    store.write_text(rel, json.dumps(report, indent=2, default=str))
    get_run_logger().info(f"checkpoint valid: {report.get('tensors', report.get('counts', ''))}")
    return {"uri": store.uri(rel), "ok": True, "checkpoint_sha256": ckpt["sha256"]}
