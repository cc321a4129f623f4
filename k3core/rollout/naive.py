"""Plain references for ``k3core.rollout.sampling``: one row at a time, written out, slow.

Nothing in the engine calls these; tests hold the batched filter and sampler to them.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and outside the smallest set whose probability
    reaches top_p (the token that crosses top_p is kept). logits ``[B, V]`` fp32, one top_k / top_p
    for all rows."""
    out = logits.clone()
    if top_k and top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> tuple[int, float]:
    """One row: (token, logprob) for logits ``[V]`` and the uniform ``u``, by a Python walk of the CDF."""
    if temperature == 0:
        tok = int(logits.argmax())
        return tok, float(torch.log_softmax(logits.double(), -1)[tok])
    scaled = logits.double() / temperature
    probs = torch.softmax(filter_logits(scaled.unsqueeze(0), top_k, top_p)[0], -1)
    target, acc = u * float(probs.sum()), 0.0
    tok = len(probs) - 1
    for i, p in enumerate(probs.tolist()):
        acc += p
        if acc > target:
            tok = i
            break
    return tok, float(torch.log_softmax(scaled, -1)[tok])
