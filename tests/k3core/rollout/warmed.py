"""A warmed-up `small` checkpoint for decode-agreement tests, built once per process (about 30 s
on 2 cores): greedy choices with clear margins, see ``k3core.rollout.agreement``."""

from __future__ import annotations

import copy
import functools

import torch

from k3core.config import K3Config
from k3core.rl.warmup import warmed_up_model

SMALL = K3Config.preset("small")


@functools.lru_cache(maxsize=2)
def _warmed(seed: int):
    return warmed_up_model(SMALL, steps=25, seed=seed)


def warmed(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A fresh copy of the warmed-up model (fp32 master on the CPU, cached), cast and moved."""
    m = copy.deepcopy(_warmed(seed)).to(device).cast(dtype).eval()
    m.use_inference_caches = True
    m.refresh_inference_caches()
    return m


def reverse_prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    """``n`` held-out `reverse` prompts, tokenized (about 10 tokens each)."""
    from k3core.rl.data import heldout_prompts
    from k3core.rl.envs import load_env
    from k3core.tokenizer import ByteTokenizer

    tok = ByteTokenizer(SMALL)
    return [tok.encode(p) for p in heldout_prompts(load_env("reverse"), seed, n, "reverse")]
