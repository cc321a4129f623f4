"""Where a run's artifacts live under the artifact root: ``runs/<run_id>/``.

Owns: every path of a run relative to the artifact root (the prepared weights, each iteration's
files, checkpoints, the records the flow keeps beside them, the lock), for the stages that publish
them and for the readers that find a run by its id alone (``k3rl status``, the run lock, resume,
retention). Does not own: the store those paths live in (``k3core.artifacts.ArtifactStore``), what
the files hold (the stages and ``flows.reports``). No torch, no Prefect: readers that only summarise
a run import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["RUNS", "RunLayout", "RunRecordError", "parse_record"]

RUNS = "runs"  # the folder of every run under the artifact root


@dataclass(frozen=True)
class RunLayout:
    """The relative paths (``/``-separated, as ``ArtifactStore`` takes them) of run ``run_id``."""

    run_id: str

    def rel(self, *parts: str) -> str:
        """``runs/<run_id>/<parts...>`` (the run's directory without ``parts``)."""
        return "/".join((RUNS, self.run_id, *parts))

    def iter_rel(self, iteration: int, name: str) -> str:
        """A file of iteration ``iteration``: ``iter-NNNN/<name>``."""
        return self.rel(f"iter-{iteration:04d}", name)

    def trainer_rel(self, iteration: int) -> str:
        """The trainer state the train step of ``iteration`` publishes (weight version ``iteration + 1``)."""
        return self.iter_rel(iteration, "trainer")

    def checkpoint_rel(self, version: int) -> str:
        """The committed checkpoint of weight ``version`` (what ``latest.json`` and resume point at)."""
        return self.rel("checkpoints", f"iter-{version:04d}")

    def curves_rel(self, iterations: int) -> str:
        """The reward and KL curves after ``iterations`` iterations (PNG)."""
        return self.rel(f"curves-{iterations:04d}.png")

    @property
    def latest(self) -> str:
        """The pointer to the last committed checkpoint, written last by each save."""
        return self.rel("latest.json")

    @property
    def metrics(self) -> str:
        """One metrics dict per finished iteration."""
        return self.rel("metrics.json")

    @property
    def lineage(self) -> str:
        """The artifacts of prepare and of each finished iteration (what resume reads back)."""
        return self.rel("lineage.json")

    @property
    def summary(self) -> str:
        """The end-of-run report."""
        return self.rel("summary.json")

    @property
    def settings(self) -> str:
        """The recorded settings of a scheduled run (its first ``rl_continue`` tick writes them)."""
        return self.rel("settings.json")

    @property
    def tokenizer(self) -> str:
        """The source checkpoint's tokenizer files and its config.json (``fetch_checkpoint``): what
        every stage tokenizes with, small enough to read on any machine without the weights."""
        return self.rel("tokenizer")

    @property
    def validation(self) -> str:
        """The source checkpoint's validation report."""
        return self.rel("source.validation.json")

    @property
    def lock(self) -> str:
        """The run's lock file (``flows.runlock``: on local disk, in the cache of a remote root)."""
        return self.rel(".lock")


class RunRecordError(ValueError):
    """A run record (``latest.json``, ``metrics.json``, ``lineage.json``, ``summary.json``) that is
    not what k3rl writes: named, with the fix."""


_SHAPES = {"metrics.json": (list, "a list of per-iteration metrics"),
           "lineage.json": (dict, "an object with the iterations' artifacts"),
           "latest.json": (dict, "an object naming the latest checkpoint"),
           "summary.json": (dict, "an object summarising the run")}
_MAX_DEPTH = 64  # k3rl's records nest a few levels; far deeper is not one of them (and recursion-bound)


def _depth(text: str) -> int:
    """How deep ``text``'s brackets nest (outside strings): checked before ``json.loads`` recurses."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, in_string) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_record(text: str, where: str) -> object:
    """The JSON of the run record at ``where`` (its path or URI; its file name gives the expected
    shape), or ``RunRecordError`` naming the file, what is wrong and the fix."""
    name = where.rstrip("/").rsplit("/", 1)[-1]
    kind, what = _SHAPES.get(name, (object, "JSON"))
    fix = ("k3rl rewrites it after each recorded iteration: restore it from a copy, or delete metrics.json and "
           "lineage.json together to have the run re-recorded from iteration 0 (its published tables and "
           "checkpoints are found, not made again)") if name != "latest.json" else (
           "restore it from a copy, or delete it and resume: the run then starts from its recorded iterations")
    if _depth(text) > _MAX_DEPTH:
        raise RunRecordError(f"{where} nests deeper than {_MAX_DEPTH} levels: not a k3rl run record; {fix}")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise RunRecordError(f"{where} is not valid JSON ({e}); {fix}") from None
    if not isinstance(value, kind):
        raise RunRecordError(f"{where} holds {type(value).__name__}, not {what}; {fix}")
    return value
