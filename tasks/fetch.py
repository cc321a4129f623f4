"""fetch_checkpoint: a source (fsspec URL, or ``init:PRESET[:SEED]`` for a fresh seeded checkpoint)
-> a local public-layout checkpoint directory under the run."""

from __future__ import annotations

from prefect import get_run_logger

from k3core.artifacts import Artifact
from tasks.common import Run, stage


def _rel(run: Run) -> str:
    return run.rel("source")


@stage(run_name="fetch_checkpoint", key="fetch", outputs=lambda run, **_: [run.uri(_rel(run))])
def fetch_checkpoint(run: Run, source: str) -> Artifact:
    log = get_run_logger()

    def build(tmp):
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

    run.store.publish_once(_rel(run), build, is_dir=True)
    return run.store.handle(_rel(run), "hf", version=0, inner="ckpt", source=source)
