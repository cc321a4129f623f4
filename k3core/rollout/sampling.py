"""Sampling for the rollout engine: one token per running sequence from its next-token logits.

Owns: ``SamplingParams``, the seeds of a request's samples (``derive_seed``, ``sample_generator``),
the per-row top-k / top-p filter and the inverse-CDF draw (``sample_batch``). Does not own: which
sequences run or when they stop (``k3core.rollout.engine``); the plain per-row references the tests
hold these to live in ``k3core.rollout.naive``.

``logprobs`` are ``log softmax(logits / temperature)`` of the sampled token, before top-k / top-p
truncation: the distribution the trainer re-computes (temperature 0: greedy, log-probs at
temperature 1). Top-k keeps logits >= the k-th largest; top-p then keeps the smallest prefix of the
top-k-renormalised distribution whose mass reaches ``top_p`` (the crossing token is kept).

A token is drawn by inverse CDF from one uniform of the sequence's own CPU generator per step (none
for a greedy sequence), so a request's samples depend only on its prompt, its parameters and its
seed, never on which requests share the batch. Sample ``j`` of a request with seed ``s`` uses
generator seed ``s + j`` (so sending the same prompt as ``n`` one-sample requests with seeds
``s, s+1, ...`` gives the same samples; ``RolloutClient`` does this against a server), and
``RolloutEngine.generate`` gives prompt ``i`` of a call with seed ``s`` the request seed
``derive_seed(s, i)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None

    def validate(self) -> None:
        errs = []
        if self.max_new_tokens < 1:
            errs.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            errs.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errs.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            errs.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            errs.append(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not 0 <= int(self.seed) <= MASK63:
            errs.append(f"seed must be in [0, 2^63), got {self.seed}")
        if errs:
            raise ValueError("invalid sampling parameters: " + "; ".join(errs))


def derive_seed(base: int, index: int) -> int:
    """A well-mixed 63-bit seed for item ``index`` of a call seeded ``base`` (splitmix64)."""
    z = (int(base) * 0x9E3779B97F4A7C15 + (int(index) + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & MASK63


def sample_generator(seed: int, sample_index: int) -> torch.Generator:
    """The CPU generator of sample ``sample_index`` of a request seeded ``seed``."""
    return torch.Generator(device="cpu").manual_seed((int(seed) + sample_index) & MASK63)


def filter_logits_batched(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p drop, with one top_k (``[B]`` int, 0 = off) and top_p
    (``[B]`` float, 1 = off) per row, in one sort. logits ``[B, V]`` fp32 -> ``[B, V]``."""
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V)).to(torch.long)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    drop_sorted = sorted_logits < kth
    probs = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    drop_sorted |= (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row the first token whose cumulative probability exceeds ``u * total``.
    probs ``[B, V]`` (>= 0, need not be normalised), u ``[B]`` in [0, 1) -> token ids ``[B]``.
    A zero-probability token is never drawn (the CDF is flat across it)."""
    cdf = probs.double().cumsum(-1)
    x = (u.double().to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    tok = torch.searchsorted(cdf, x, right=True).squeeze(1)
    # u == 1 (never from torch.rand, but rounding can put x at the total): the last possible token
    V = probs.shape[-1]
    last = V - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(-1)
    return torch.where(tok >= V, last, tok)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: logits ``[B, V]`` (fp32; fp64 for an fp64 model), row ``i`` sampled with
    ``params[i]`` and a uniform from ``generators[i]`` -> (tokens ``[B]``, logprobs ``[B]``)."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    greedy = temp == 0
    argmax = logits.argmax(-1)
    if bool(greedy.all()):
        return argmax, torch.log_softmax(logits, -1).gather(1, argmax.unsqueeze(1)).squeeze(1)
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)
    logp = torch.log_softmax(scaled, -1)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
    if bool((top_k > 0).any() or (top_p < 1).any()):
        scaled = filter_logits_batched(scaled, top_k, top_p)
    probs = torch.softmax(scaled, -1)
    # one uniform per sampling sequence from its own generator: batch composition never matters
    u = torch.tensor([0.0 if p.temperature == 0 else float(torch.rand((), generator=g, dtype=torch.float64))
                      for p, g in zip(params, generators)], dtype=torch.float64)
    tok = torch.where(greedy, argmax, sample_from_probs(probs, u))
    return tok, logp.gather(1, tok.unsqueeze(1)).squeeze(1)
