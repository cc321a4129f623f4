"""validate_checkpoint: fail-closed structure and hash audit; a JSON report published only when
everything passes (a failure raises and is not retried)."""

from __future__ import annotations

import json

from prefect import get_run_logger

from k3core.artifacts import Artifact
from tasks.common import Run, stage


def _rel(run: Run) -> str:
    return run.rel("source.validation.json")


@stage(run_name="validate_checkpoint", key="validate", outputs=lambda run, **_: [run.uri(_rel(run))],
       inputs=lambda checkpoint, **_: [checkpoint.uri])
def validate_checkpoint(run: Run, checkpoint: Artifact, preset: str | None = None) -> Artifact:
    from k3core.checkpoint.validate import validate_checkpoint as validate
    from k3core.config import K3Config

    config = K3Config.preset(preset) if preset else None
    report = validate(checkpoint.path, config=config)
    report = report if isinstance(report, dict) else report.to_dict()
    run.store.write_text(_rel(run), json.dumps(report, indent=2, default=str))
    tok = report.get("tokenizer")
    get_run_logger().info(f"checkpoint valid: {report.get('tensors', report.get('counts', ''))}; tokenizer: "
                          + (f"{tok['format']}, {tok['vocab_size']:,} ids" if tok else "bytes"))
    return run.store.handle(_rel(run), "report", checkpoint_sha256=checkpoint.sha256)
