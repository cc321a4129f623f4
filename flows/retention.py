"""Retention of a run's trainer states (``--keep-checkpoints N``).

Owns: which checkpoints of a run are kept, and their deletion. A checkpoint of weight version v is
two published directories holding the same files (hard links where the filesystem allows):
``runs/<id>/checkpoints/iter-v`` (the manifest, what resume and ``latest.json`` point at) and
``runs/<id>/iter-(v-1)/trainer`` (the train step's output). Both go together. Rollout and score
tables, metrics, lineage and the prepared weights (source, warm-up, rollout weights v0) are never
deleted: they are small, and a resumed run must never regenerate a published rollout.

Kept, whatever N is:
- the newest N checkpoints (with ``--save-every K`` there is one every K versions: the newest N of
  those);
- the latest (``latest.json``): resume continues from it and the engine serves it;
- with ``--max-staleness K``, the K before it: a resumed run samples a batch that is not published
  yet with the version K before its iteration.

Deleting is safe against crashes and never touches work in flight: pruning runs in the flow after
an iteration is recorded (``lineage.json``, ``metrics.json``), when no stage is writing, and only
below the latest published version; each directory loses its completion marker before its files
(``ArtifactStore.remove``), so an interrupted delete leaves a leftover no reader trusts.
"""

from __future__ import annotations

from k3core.artifacts import ArtifactStore
from k3core.rl.layout import RunLayout
from k3core.settings import RLSettings

__all__ = ["checkpoints_to_keep", "prune_checkpoints"]


def checkpoints_to_keep(latest: int, keep: int, max_staleness: int = 0, saved: list[int] | None = None) -> set[int]:
    """Weight versions (1..``latest``) whose checkpoints stay; ``keep`` 0 keeps them all. ``saved``:
    the versions that have one (default: every version). Under ``max_staleness`` K the K before the
    latest stay too: a resumed run samples a batch it has not published yet with the version K before
    its iteration."""
    versions = sorted(v for v in (saved if saved is not None else range(1, latest + 1)) if 1 <= v <= latest)
    if latest not in versions:
        versions.append(latest)
    if keep <= 0:
        return set(versions)
    needed = {latest} | set(versions[-(max_staleness + 1):])
    return set(versions[-keep:]) | needed


def prune_checkpoints(s: RLSettings, latest: int) -> list[int]:
    """Delete the checkpoints (and their trainer states) of versions below ``latest`` that
    ``checkpoints_to_keep`` does not keep; return the versions deleted, oldest first."""
    if s.pipeline.keep_checkpoints <= 0:
        return []
    store, layout = ArtifactStore(s.pipeline.artifacts), RunLayout(s.pipeline.run_id)
    saved = [v for v in range(1, latest + 1) if store.exists(layout.checkpoint_rel(v))]
    keep = checkpoints_to_keep(latest, s.pipeline.keep_checkpoints, s.grpo.max_staleness, saved)
    removed = []
    for v in range(1, latest):
        if v in keep:
            continue
        ckpt, trainer = layout.checkpoint_rel(v), layout.trainer_rel(v - 1)
        # the checkpoint first (what resume reads); a crash before the trainer state goes leaves
        # only that state behind, which the next pruning finds and deletes
        found = store.remove(ckpt)
        found = store.remove(trainer) or found
        if found:
            removed.append(v)
    return removed
