"""Greedy agreement of a decode path with the no-cache forward: the check that tells a decode-state
bug from rounding.

For each greedy completion, the same model's no-cache forward reads the prompt and the completion's
tokens (teacher forcing) and picks its own greedy token at every generated position. ``agreement``
is the fraction of positions where the decoded token is an argmax of the forward's logits (in bf16
the top two logits can be exactly equal: either pick is the forward's greedy choice). Teacher
forcing keeps one parting from moving every later position: each position is judged on the same
prefix.

What it can tell apart depends on the checkpoint. In bf16 the decode path and the forward round
differently (recurrent vs chunked KDA, absorbed vs expanded MLA), so positions whose top-2 logits are
within rounding of each other part for no fault of either. Random-init weights put most positions
at such near-ties, so there the criterion cannot separate a bug from rounding; after a short
supervised warm-up (``k3core.rl.warmup.warmed_up_model``) the margins are wide, every correct mode
agrees, and a planted decode-state bug (the KDA state decayed by 1% per step) falls below the
criterion (``tests/k3core/rollout/test_decode_agreement.py``). The criterion is therefore: at least
99% on a warmed-up checkpoint, and every parting at a near-tie (``Parting.margin``). The measured
agreements and margins: docs/results/rollout_decode.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Parting:
    """One generated position where the decode path and the forward picked other tokens."""

    sequence: int
    position: int  # index into the completion's output_ids
    decoded: int
    forward: int
    margin: float  # the forward's top-2 logit margin there: small means a near-tie


@dataclass
class Agreement:
    agree: int = 0
    total: int = 0
    partings: list[Parting] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # the forward's top-2 margin at every position

    @property
    def fraction(self) -> float:
        return self.agree / self.total if self.total else 1.0

    def median_margin(self) -> float:
        return float(torch.tensor(self.margins).median()) if self.margins else float("nan")

    def describe(self) -> str:
        first = ", ".join(f"seq {p.sequence} pos {p.position}: {p.decoded} vs {p.forward} (margin {p.margin:.3f})"
                          for p in self.partings[:4])
        return (f"greedy agreement {self.agree}/{self.total} = {self.fraction:.4f}, median top-2 margin "
                f"{self.median_margin():.3f}" + (f"; first partings: {first}" if first else ""))


def greedy_outputs(model, prompts: list[list[int]], mode: str, max_new_tokens: int = 24,
                   max_batch: int = 4) -> list[list[int]]:
    """Greedy completions of ``prompts`` through a ``RolloutEngine`` around ``model`` (taken over:
    pass a copy) in decode ``mode``; with ``max_batch`` below the number of prompts, sequences join
    and leave the running batch."""
    from k3core.rollout.engine import RolloutEngine, SamplingParams

    eng = RolloutEngine(model, max_batch=max_batch, decode=mode)
    if eng.decode_mode != mode:
        raise ValueError(f"the engine decodes in {eng.decode_mode!r}, not the {mode!r} asked for")
    futures = [eng.submit(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=0)) for p in prompts]
    while eng.step():
        pass
    return [f.result()[0].output_ids for f in futures]


@torch.no_grad()
def greedy_agreement(model, prompts: list[list[int]], outputs: list[list[int]]) -> Agreement:
    """Teacher-forced agreement of greedy ``outputs`` (one per prompt, decoded by any path) with
    ``model``'s no-cache forward. ``model`` is called as ``model(ids)`` on the device of its
    parameters, one sequence at a time (no padding involved)."""
    dev = next(model.parameters()).device
    result = Agreement()
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if not out:
            continue
        ids = torch.tensor([list(prompt) + list(out[:-1])], device=dev)
        logits = model(ids).logits[0, len(prompt) - 1:].float()
        top = logits.topk(2, dim=-1)
        margins = (top.values[:, 0] - top.values[:, 1]).tolist()
        picks = top.indices[:, 0].tolist()
        chosen = logits.gather(1, torch.tensor(out, device=dev)[:, None])[:, 0]
        hits = (chosen >= top.values[:, 0]).tolist()  # an argmax of the forward (bf16 logits tie exactly)
        result.margins.extend(margins)
        for j, (want, got) in enumerate(zip(picks, out)):
            result.total += 1
            if hits[j]:
                result.agree += 1
            else:
                result.partings.append(Parting(i, j, got, want, margins[j]))
    return result
