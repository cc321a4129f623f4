"""Checks of a run's inputs before any work: before Prefect starts, before the run lock is taken,
before anything is written under the artifact root.

Owns: ``check_settings`` (what ``k3rl run`` and ``k3rl prepare`` check beyond the settings
sections' own validation): the environment loads, the scale-out setting is usable, the source is a
checkpoint, the artifact root can be written, and a local root has room for what the run will
write (``check_disk``: the peak bytes of ``k3core.rl.disk`` against the free space). Each failure is a ``ValueError`` whose message names
the flag, the problem and the fix; the CLI prints it as one error with exit status 2.
Does not own: the settings' own checks (``k3core.settings``, which deployments run too), or the
fail-closed audit of a fetched checkpoint (the ``validate_checkpoint`` stage hashes every file). A
source on a remote filesystem is read first by the fetch stage, whose retries absorb a transient
error that a check here would turn into a refusal; here only its filesystem must be known.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_artifact_root", "check_disk", "check_settings", "check_source"]


def check_settings(s, prepare_only: bool = False) -> None:
    """Everything a run's settings name that can be checked on this machine, cheaply, up front.
    ``prepare_only``: ``k3rl prepare`` (the disk must hold the prepared weights, not the iterations)."""
    from flows.scale import check_runner
    from flows.trackers import check_trackers
    from k3core.device import decode_mode, run_device
    from k3core.rl.envs import load_env

    env = load_env(s.pipeline.env)
    check_artifact_root(s.pipeline.artifacts, s.pipeline.run_id)
    if not _source_fetched(s.pipeline.artifacts, s.pipeline.run_id):
        check_source(s.model.source, s.model.preset)
    check_disk(s, env, prepare_only=prepare_only)  # after the source: it sizes the run from the source's config
    check_runner(s.scale_out)
    check_trackers(s)
    decode_mode(run_device(s), s.rollout.decode)  # --device cuda where torch sees no GPU; --decode graph on the CPU


def _source_fetched(artifacts: str, run_id: str) -> bool:
    """Whether the run has already published its fetched source (a resume never reads the source
    again, so a source moved away since must not refuse it). Local roots only: a remote root's
    marker is left to the fetch stage, which finds it and skips."""
    from k3core.artifacts import COMPLETE
    from k3core.rl.layout import RunLayout

    path = _local_path(artifacts)
    return path is not None and (path / RunLayout(run_id).rel("source") / COMPLETE).is_file()


def _local_path(url: str) -> Path | None:
    """The local path a path or ``file://`` URL names; None for any other filesystem."""
    if url.startswith("file://"):
        return Path(url[len("file://"):])
    return None if "://" in url else Path(url)


def check_source(source: str, preset: str) -> None:
    """``--source``: ``init:`` specs were checked by the settings; a URL's filesystem must exist; a
    local directory must be a public-layout checkpoint of ``preset`` (config, index and every
    shard's header: a truncated, missing or mis-shaped shard is named here, no file is hashed)."""
    if source.startswith("init:"):
        return
    from k3core.checkpoint.fetch import resolve_filesystem
    from k3core.checkpoint.validate import CheckpointValidationError, audit_structure
    from k3core.config import K3Config

    path = _local_path(source)
    if path is None:
        try:
            resolve_filesystem(source)
        except ImportError as e:
            raise ValueError(f"--source {source!r}: {e}; use a directory, a file://, s3:// or hf:// URL, or "
                             "init:PRESET[:SEED[:TOKENIZER]] for a fresh checkpoint") from None
        return
    if not path.exists():
        raise ValueError(f"--source {source}: no such directory; give a checkpoint directory (config.json, index, "
                         "shards), or init:PRESET[:SEED[:TOKENIZER]] for a fresh one")
    if not path.is_dir():
        raise ValueError(f"--source {source} is a file; give the checkpoint's directory (config.json, index, shards)")
    try:
        audit_structure(path, K3Config.preset(preset))
    except CheckpointValidationError as e:
        raise ValueError(f"--source {source} is not a usable '{preset}' checkpoint: {e}; point --source at a "
                         f"complete checkpoint of that preset (`k3rl checkpoint validate DIR` audits one)") from None


def check_artifact_root(artifacts: str, run_id: str) -> None:
    """``--artifacts``: another filesystem's protocol must be known (its package installed); a local
    root must be a directory, or creatable, and writable where the run will write (its run directory,
    or the nearest directory above it that exists), and hold no symbolic link under the run's directory
    that leads outside the root. Nothing is created in a local root; a remote one gets a small object
    written, read back and removed."""
    path = _local_path(artifacts)
    if path is None:
        import fsspec

        protocol = artifacts.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as e:
            raise ValueError(f"--artifacts {artifacts}: no filesystem for {protocol}:// ({e}); use a directory or a "
                             "URL of an installed fsspec filesystem (s3:// needs s3fs)") from None
        from k3core.artifacts import ArtifactStore

        ArtifactStore(artifacts).check_access()  # a missing bucket, denied access: StorageError, exit 2
        return
    if path.exists() and not path.is_dir():
        raise ValueError(f"--artifacts {artifacts} is a file, not a directory; point --artifacts at a directory "
                         "(it is created when missing)")
    from k3core.rl.disk import existing_dir
    from k3core.rl.layout import RunLayout

    for target in (path / RunLayout(run_id).rel(), path):
        where = existing_dir(target)
        if not where.is_dir():
            raise ValueError(f"--artifacts {artifacts}: {where} is a file, so the artifact root cannot be created "
                             "there; choose another --artifacts")
        if not os.access(where, os.W_OK | os.X_OK):
            raise ValueError(f"--artifacts {artifacts}: {where} is not writable (a read-only filesystem or its "
                             "permissions); choose a writable --artifacts, or make it writable")
    from k3core.artifacts import links_leaving

    if (path / RunLayout(run_id).rel()).is_dir():
        out = links_leaving(path, RunLayout(run_id).rel())
        if out:
            link, target = out[0]
            raise ValueError(f"--artifacts {artifacts}: {link} is a symbolic link to {target}, outside the artifact "
                             f"root{f' (and {len(out) - 1} more)' if len(out) > 1 else ''}: k3rl writes and deletes "
                             "only inside its root; replace the link by the directory it names (move it in)")


def check_disk(s, env=None, prepare_only: bool = False) -> None:
    """A local artifact root must have room for the peak of what the rest of the run writes
    (``k3core.rl.disk.run_disk_need``: the trainer states at once under ``--keep-checkpoints`` and
    ``--save-every``, the prepared weights not yet published, the tables of the iterations left);
    a resumed run counts only what remains. Refused with the free space, the need and the flags
    under which it fits. A remote root is not measured (its store's own errors name a full bucket)."""
    from k3core.rl import disk

    root = _local_path(s.pipeline.artifacts)
    if root is None:
        return
    progress = disk.run_progress(root, s.pipeline.run_id)
    if prepare_only:
        s = disk.with_pipeline(s, iterations=0)  # the prepared weights alone
    tokens, agentic = _prompt_tokens(env, s.pipeline.seed)
    source_bytes = _local_size(s.model.source)

    def need_of(x):
        return disk.run_disk_need(x, progress, tokens, agentic, source_bytes=source_bytes)

    need, free = need_of(s), disk.free_bytes(root)
    if need.total <= free:
        return
    resumed = " (what remains of this run)" if progress != disk.RunProgress() else ""
    fits = disk.fitting_flags(s, free, need_of)
    raise ValueError(f"--artifacts {s.pipeline.artifacts}: {disk.gb(free)} free on {disk.existing_dir(root)}, but the "
                     f"run needs {disk.gb(need.total)}{resumed} at its peak ({need.describe()}); it would fit with "
                     + "; or ".join(fits))


def _prompt_tokens(env, seed: int) -> tuple[int, bool]:
    """An upper bound of the run's prompt length in tokens (a token is at least one byte of the
    prompt's text, plus the chat template around it) from a sample of the environment's prompts,
    and whether its episodes are agentic (their length is ``--max-episode-tokens``)."""
    import random

    from k3core.rl.disk import TEMPLATE_TOKENS
    from k3core.rl.episodes import is_agentic

    if env is None:
        return 1024, False
    try:
        longest = max(len(p.encode()) for p in env.prompts(random.Random(seed), 64))
    except Exception:  # an environment's own failure is the rollout's to report, with its traceback
        longest = 1024
    return 2 * longest + TEMPLATE_TOKENS, is_agentic(env)


def _local_size(source: str) -> int | None:
    """Bytes of a local source checkpoint (what the fetch copies), None for any other."""
    path = None if source.startswith("init:") else _local_path(source)
    if path is None or not path.is_dir():
        return None
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
