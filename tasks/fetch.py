"""fetch_checkpoint: a source (fsspec URL, or ``init:PRESET[:SEED[:TOKENIZER]]`` for a fresh seeded
checkpoint, TOKENIZER ``bytes`` (the default) or ``bpe``) -> a local public-layout checkpoint
directory under the run, and beside it the run's tokenizer (``RunLayout.tokenizer``: the
checkpoint's tokenizer data files and its config.json, what every later stage tokenizes with)."""

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

            preset, seed, tokenizer = parse_init_source(source)
            log.info(f"creating a fresh '{preset}' checkpoint (seed {seed}, tokenizer {tokenizer}) in the public HF layout")
            init_checkpoint(preset, tmp / "ckpt", seed=seed, format="bf16", tokenizer=tokenizer)
        else:
            from k3core.checkpoint.fetch import fetch

            log.info(f"fetching {source}")
            fetch(source, tmp / "ckpt")

    path = run.store.publish_once(_rel(run), build, is_dir=True)
    run.store.publish_once(run.layout.tokenizer, lambda tmp: copy_tokenizer(path / "ckpt", tmp), is_dir=True)
    return run.store.handle(_rel(run), "hf", version=0, inner="ckpt", source=source)


def parse_init_source(source: str) -> tuple[str, int, str]:
    """``init:PRESET[:SEED[:TOKENIZER]]`` -> (preset, seed, tokenizer)."""
    _, preset, *rest = source.split(":")
    if len(rest) > 2 or not preset:
        raise ValueError(f"--source {source!r}: write init:PRESET[:SEED[:TOKENIZER]], e.g. init:small, init:small:1 "
                         "or init:small:0:bpe")
    try:
        seed = int(rest[0]) if rest and rest[0] else 0
    except ValueError:
        raise ValueError(f"--source {source!r}: the seed {rest[0]!r} is not an integer") from None
    tokenizer = rest[1] if len(rest) > 1 else "bytes"
    if tokenizer not in ("bytes", "bpe"):
        raise ValueError(f"--source {source!r}: tokenizer {tokenizer!r} is not bytes or bpe (a tokenizer of your own: "
                         "`k3rl checkpoint init --tokenizer DIR`, then --source that checkpoint)")
    return preset, seed, tokenizer


def copy_tokenizer(checkpoint, out) -> None:
    """The tokenizer data files of ``checkpoint`` and its config.json into the (empty, staged)
    directory ``out``."""
    import shutil
    from pathlib import Path

    from k3core.checkpoint.hf import tokenizer_files

    for name, path in {"config.json": Path(checkpoint) / "config.json", **tokenizer_files(checkpoint)}.items():
        shutil.copyfile(path, out / name)
