"""save_checkpoint: commit a trained state as the run's checkpoint for that weight version: the
files (hard-linked where possible), a manifest of their sha256 (``published_sha256``: a linked file's
digest is the one its trainer-state handle computed, not a second read of the whole state, which
holds the optimizer's host state beside the weights: docs/results/gpu_loop.md has its size at the
medium preset), then the ``latest`` pointer, last."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from k3core.artifacts import Artifact, published_sha256, sha256_file
from tasks.common import Run, stage


@stage(run_name="save_checkpoint-iter{iteration}", key="save",
       outputs=lambda run, trained, **_: [run.uri(run.checkpoint_rel(trained.version))],
       inputs=lambda trained, **_: [trained.uri])
def save_checkpoint(run: Run, iteration: int, trained: Artifact) -> Artifact:
    """The checkpoint of ``trained`` (weight version ``trained.version``, after iteration ``iteration``)."""
    store, rel = run.store, run.checkpoint_rel(trained.version)
    src = Path(trained.path)

    def build(tmp):
        names, linked = [], []
        for p in sorted(x for x in src.rglob("*") if x.is_file()):
            dst = tmp / "state" / p.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, dst)
            except OSError:
                shutil.copy2(p, dst)
            names.append(str(p.relative_to(src)))
            linked.append(dst)
        # a hard link is the trained state's own file, whose bytes its handle already hashed: a stat
        files = dict(zip(names, published_sha256(linked)))
        manifest = {"run_id": run.run_id, "iteration": trained.version, "version": trained.version,
                    "trained_from": trained.uri, "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))

    local = store.publish_once(rel, build, is_dir=True)
    pointer = {"run_id": run.run_id, "iteration": trained.version, "checkpoint": store.uri(rel),
               "version": trained.version}
    store.replace_text(run.layout.latest, json.dumps(pointer, indent=2))  # last: a crash before keeps the old
    return Artifact(kind="dcp", uri=store.uri(rel), path=str(local / "state"), sha256=sha256_file(local / "manifest.json"),
                    version=trained.version, info={"manifest": store.uri(f"{rel}/manifest.json")})
