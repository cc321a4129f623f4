"""Delta transfer bookkeeping on the sender: what the engine holds, so only changed tensors travel.

Owns: ``DeltaTracker``, the per-item digests of the last version the receiver acknowledged. A
sender hashes every wire item of the new version (it has to, to know what changed), sends the items
whose digest differs, and lists the others as ``unchanged`` (name + digest, no bytes). The receiver
refuses the delta unless its own version is the tracker's base version and each unchanged tensor it
holds has that digest (``receive(..., base=...)``), so a delta can never be applied on top of
weights other than the ones it was computed against.

The tracker moves forward only on ``commit`` (called once the receiver has acknowledged), so a
refused or lost transfer leaves it at the last version the engine really has. ``reset`` forgets
everything: the next transfer is a full one (do that after a refusal).
"""

from __future__ import annotations

__all__ = ["DeltaTracker"]


class DeltaTracker:
    """Sender-side digests of the last acknowledged version.

    ``algo``: digest algorithm (fixed for the tracker's life: digests of different algorithms never
    compare equal). ``version``: the base a delta is computed against (None: nothing acknowledged,
    the next transfer is full)."""

    def __init__(self, algo: str | None = None):
        self.algo = algo
        self.version: int | None = None
        self.digests: dict[str, str] = {}

    def base(self, algo: str) -> tuple[int | None, dict[str, str]]:
        """(base version, digests) a new transfer may diff against; empty when the algorithm differs."""
        if self.algo is None:
            self.algo = algo
        if algo != self.algo or self.version is None:
            return None, {}
        return self.version, self.digests

    def commit(self, version: int, digests: dict[str, str], algo: str) -> None:
        """The receiver acknowledged ``version`` whose items have ``digests`` (every item of the
        version, sent or unchanged)."""
        self.algo, self.version, self.digests = algo, version, dict(digests)

    def reset(self) -> None:
        self.version, self.digests = None, {}
