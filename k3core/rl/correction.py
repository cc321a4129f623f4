"""Rollout correction: importance weights and rejection masks for the rollout engine's mismatch
(other kernels, MXFP4 experts, stale weights). Pure tensor math on one rollout batch, per sequence;
no model, no I/O. ``grpo.py`` applies the result; ``train.py`` computes it once per batch.

Per trained token t of sequence i, with ``logp_old`` the trainer's log-probability before the
batch's first update and ``logp_rollout`` the engine's:
  log rho_t = logp_old_t - logp_rollout_t                  rho_t = p_trainer / p_rollout

Importance weight (``rollout_is``, truncated at ``cap``; detached, multiplies the token's loss):
  token      w_t = min(rho_t, cap)                                     token TIS (the default)
  sequence   w_t = min(prod_{s in i} rho_s, cap)  for every t of i    sequence-level TIS
  none       w_t = 1
Rejection (``rollout_rs``, a band [low, high]; a rejected token leaves the loss mask, so it counts in
no aggregation denominator either):
  none       keep every token
  token      keep t  iff  low <= rho_t <= high                         token masking
  sequence   keep i  iff  low <= prod_{s in i} rho_s <= high           sequence masking
  geometric  keep i  iff  low <= exp(mean_{s in i} log rho_s) <= high  geometric-mean masking

The peers' named corrections are combinations of the two:
  TIS (token)          ``rollout_is=token``, ``rollout_rs=none``              w = min(rho, C)
  IcePop               ``rollout_is=token``, ``rollout_rs=token``, band [a, b], cap b (never engages)
                       (Ring-1T: loss_t ~ 1[a <= rho_t <= b] rho_t A_t; a=0.5, b=5)
  MIS (masked IS)      ``rollout_is=sequence``, ``rollout_rs=sequence``, band [0, C], cap C
                       (w = rho_seq where rho_seq <= C, the sequence dropped otherwise; token-level
                       MIS: ``rollout_is=token``, ``rollout_rs=token``, band [0, C])
  sequence TIS         ``rollout_is=sequence``, ``rollout_rs=none``
  geometric masking    ``rollout_rs=geometric``, band [0.99, 1.01] (SkyRL's recommendation)

Products of many ratios over- or underflow: sums of log-ratios are clamped to [-20, 20] before
``exp`` (a band or cap beyond e^20 is not meaningful).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3core.settings import IS_LEVELS, RS_LEVELS

__all__ = ["IS_LEVELS", "RS_LEVELS", "Correction", "rollout_correction", "ratio_quantiles"]

LOG_BOUND = 20.0
QUANTILES = (0.01, 0.5, 0.99)


@dataclass
class Correction:
    """Per sequence (its trained tokens, in order): the importance weight and the kept mask, and the
    batch's statistics (``stats``: masked fractions, ratio quantiles)."""

    weights: list[torch.Tensor]
    keep: list[torch.Tensor]
    stats: dict[str, float]


def _check(is_level: str, rs_level: str, low: float, high: float) -> None:
    if is_level not in IS_LEVELS:
        raise ValueError(f"rollout_is {is_level!r}: choose one of {', '.join(IS_LEVELS)}")
    if rs_level not in RS_LEVELS:
        raise ValueError(f"rollout_rs {rs_level!r}: choose one of {', '.join(RS_LEVELS)}")
    if not (0.0 <= low < high):
        raise ValueError(f"rejection band [{low}, {high}]: need 0 <= low < high")


def rollout_correction(log_rho: list[torch.Tensor], is_level: str = "token", cap: float | None = 2.0,
                       rs_level: str = "none", low: float = 0.5, high: float = 2.0) -> Correction:
    """The correction of one batch (module docstring); ``log_rho``: one 1-D tensor per sequence,
    ``logp_old - logp_rollout`` over its trained tokens. ``cap`` None or inf: untruncated."""
    _check(is_level, rs_level, low, high)
    weights, keep, seq_rho = [], [], []
    for lr in log_rho:
        lr = lr.detach().double()
        tok = torch.exp(lr.clamp(-LOG_BOUND, LOG_BOUND))
        total = float(lr.sum().clamp(-LOG_BOUND, LOG_BOUND))
        geo = float(lr.mean()) if lr.numel() else 0.0
        seq_rho.append(math.exp(total))
        if is_level == "token":
            w = tok
        elif is_level == "sequence":
            w = torch.full_like(lr, math.exp(total))
        else:
            w = torch.ones_like(lr)
        if cap is not None and math.isfinite(cap):
            w = w.clamp(max=cap)
        if rs_level == "token":
            k = (tok >= low) & (tok <= high)
        elif rs_level in ("sequence", "geometric"):
            r = math.exp(total) if rs_level == "sequence" else math.exp(geo)
            k = torch.full(lr.shape, low <= r <= high, dtype=torch.bool)
        else:
            k = torch.ones(lr.shape, dtype=torch.bool)
        weights.append(w.float())
        keep.append(k)
    n_tok = sum(k.numel() for k in keep)
    kept = sum(int(k.sum()) for k in keep)
    flat = torch.cat([lr.detach().double().reshape(-1) for lr in log_rho]) if log_rho else torch.zeros(0)
    rho = torch.exp(flat)
    raw = torch.cat([torch.exp(lr.detach().double().clamp(-LOG_BOUND, LOG_BOUND)) if is_level == "token"
                     else torch.full(lr.shape, s, dtype=torch.float64) if is_level == "sequence"
                     else torch.ones(lr.shape, dtype=torch.float64)
                     for lr, s in zip(log_rho, seq_rho)]) if log_rho else torch.zeros(0)
    truncated = float((raw > cap).double().mean()) if cap is not None and math.isfinite(cap) and n_tok else 0.0
    stats = {"rs_masked_fraction": 1.0 - kept / max(n_tok, 1),
             # over every trained token, rejected ones included (the loss sees only the kept)
             "kl_rollout_trainer_k3": float((rho - 1.0 - flat).mean()) if n_tok else 0.0,
             "kl_rollout_trainer_k1": float((-flat).mean()) if n_tok else 0.0,
             "tis_truncated_fraction": truncated,
             "rs_seq_masked_fraction": sum(bool((~k).any()) for k in keep) / max(len(keep), 1),
             **ratio_quantiles(log_rho), **{f"seq_ratio_{_q(q)}": v for q, v in zip(
                 QUANTILES, _quantiles(torch.tensor(seq_rho, dtype=torch.float64)))}}
    return Correction(weights, keep, stats)


def _q(q: float) -> str:
    return f"p{round(q * 100):02d}"


def _quantiles(x: torch.Tensor) -> list[float]:
    """``QUANTILES`` of ``x`` with linear interpolation between order statistics (numpy's default;
    by sorting: ``torch.quantile`` refuses inputs of more than 2^24 elements)."""
    if x.numel() == 0:
        return [1.0] * len(QUANTILES)
    s = x.reshape(-1).sort().values
    out = []
    for q in QUANTILES:
        pos = q * (s.numel() - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, s.numel() - 1)
        out.append(float(s[lo] + (s[hi] - s[lo]) * (pos - lo)))
    return out


def ratio_quantiles(log_rho: list[torch.Tensor]) -> dict[str, float]:
    """Quantiles (1%, 50%, 99%) of the token ratio rho over every trained token of the batch."""
    flat = torch.cat([lr.detach().double().reshape(-1) for lr in log_rho]) if log_rho else torch.zeros(0)
    rho = torch.exp(flat.clamp(-LOG_BOUND, LOG_BOUND))
    return {f"ratio_rollout_{_q(q)}": v for q, v in zip(QUANTILES, _quantiles(rho))}
