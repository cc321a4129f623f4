"""Which prompts are held out: 1 in ``HELDOUT_MOD`` by a hash of the prompt text, so the split is
the same for every run, generator and dataset, and held-out reward is measured on prompts training
never sees. Its own module: the prompt stream (``data``) and dataset environments both read it."""

from __future__ import annotations

import hashlib

HELDOUT_MOD = 8


def is_heldout(prompt: str) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) % HELDOUT_MOD == 0
