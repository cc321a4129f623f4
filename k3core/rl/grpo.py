"""GRPO with PPO-style clipping and truncated importance sampling (TIS) for the rollout/trainer
mismatch. Pure tensor math: no model, no I/O.

Three log-probabilities per generated token:
  ``logp``          the trainer's, with gradient (current parameters)
  ``logp_old``      the trainer's at rollout time, no gradient (equals ``logp`` on the first update)
  ``logp_rollout``  the rollout engine's (other kernels, MXFP4 experts)

  A_i      = (r_i - mean(r_group)) / (std(r_group) + eps)          group-normalised, population std
             (r_i - mean(r_group))                                   with ``scale=False`` (Dr. GRPO)
  ratio    = exp(logp - logp_old)
  w_tis    = min(exp(logp_old - logp_rollout), tis_cap)             detached: corrects the sampler
  loss_tok = -w_tis * min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
             + kl_coef * k3_ref                                        optional penalty to a frozen reference
  k3_ref   = exp(logp_ref - logp) - (logp_ref - logp) - 1            k3 estimate of KL(trainer || reference)
  loss     = sum(loss_tok * weight)                                  weight: ``loss_weights``

A fourth, optional log-probability, ``logp_ref`` (no gradient), is a frozen reference policy's (the
run's starting weights) on the same tokens. k3_ref >= 0, is 0 where the two agree, and its mean under
samples of the trainer is KL(trainer || reference) (E_p[q/p] = 1); d k3_ref / d logp = 1 - q/p pulls
each token's log-probability back toward the reference's. The penalty is not weighted by TIS (it is a
regulariser on the trainer, not a policy-gradient estimate) and is aggregated like the rest.

Loss aggregation (``loss_weights``; ``n`` sequences and ``N`` generated tokens in the minibatch the
update averages over, ``|y_i|`` the length of completion i, ``C`` a constant):
  token-mean            weight = 1 / N                  every token counts the same (DAPO)
  seq-mean-token-mean   weight = 1 / (n |y_i|)          every sequence counts the same (GRPO paper)
  seq-sum               weight = 1 / (n C)              unnormalised token sum over a constant (Dr. GRPO;
                                                        C = the completion length cap)
The weights of a minibatch are fixed by the whole minibatch, so a minibatch split into micro-batches
gives the same loss and gradient as the unsplit one (up to float rounding).

KL(rollout || trainer) is estimated on the rollout's own samples with k3 = (rho - 1) - log rho,
rho = p_trainer / p_rollout (unbiased, non-negative), and k1 = log p_rollout - log p_trainer.
The update's own drift, ``approx_kl`` = mean((ratio - 1) - log ratio), is the k3 estimate of
KL(old || new) on the same samples: zero on an on-policy update, growing over PPO epochs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from k3core.device import to_device
from k3core.settings import LOSS_AGGREGATIONS


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """rewards ``[G * group_size]`` (groups contiguous) -> advantages, same shape, fp32: reward minus
    the group's mean, divided by the group's population std (+ eps) when ``scale``."""
    r = rewards.float()
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, group_size)
    centred = g - g.mean(1, keepdim=True)
    if scale:
        centred = centred / (g.std(1, unbiased=False, keepdim=True) + eps)
    return centred.view(-1)


def uniform_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[G]`` bool: the groups whose rewards are all equal (zero advantage whatever the scaling: no
    signal for GRPO; dynamic sampling drops them)."""
    g = rewards.float().view(-1, group_size)
    return g.amax(1) == g.amin(1)


def loss_weights(mask: torch.Tensor, mode: str = "token-mean", *, tokens: int | None = None,
                 sequences: int | None = None, norm: float | None = None,
                 seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weights ``[B, T]`` (zero off ``mask``) that aggregate per-token losses into the
    minibatch loss (module docstring). ``tokens`` / ``sequences``: the minibatch's generated tokens
    and sequences when ``mask`` is only part of it (a micro-batch; default: ``mask`` is the whole
    minibatch); ``norm``: the constant C of ``seq-sum``. ``seq_ids`` ``[B, T]``: the sequence of every
    position when a row holds several (packed sequences); default: each row is one sequence."""
    m = mask.float()
    if mode == "token-mean":
        n = float(m.sum()) if tokens is None else float(tokens)
        return m / max(n, 1.0)
    if seq_ids is not None and seq_ids.shape != mask.shape:
        raise ValueError(f"seq_ids have shape {tuple(seq_ids.shape)}, the mask {tuple(mask.shape)}")
    if seq_ids is None:
        n_ids = m.shape[0] if m.numel() else 0
        seq_ids = torch.arange(m.shape[0], device=m.device).unsqueeze(1).expand_as(m)
    else:  # the largest id, read where seq_ids live (free on the host; a host sync on a GPU)
        n_ids = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
        seq_ids = to_device(seq_ids, m.device)
    per_seq = torch.zeros(n_ids, device=m.device)
    per_seq = per_seq.index_add(0, seq_ids.reshape(-1), m.reshape(-1))  # generated tokens of each
    n_seq = float(per_seq.numel() if sequences is None else sequences)
    if mode == "seq-mean-token-mean":
        return m / per_seq[seq_ids].clamp_min(1.0) / max(n_seq, 1.0)
    if mode == "seq-sum":
        if norm is None or not norm > 0:
            raise ValueError(f"seq-sum aggregation needs a positive constant norm (the completion length cap), got {norm!r}")
        return m / (max(n_seq, 1.0) * float(norm))
    raise ValueError(f"unknown loss aggregation {mode!r}: choose one of {', '.join(LOSS_AGGREGATIONS)}")


@dataclass
class GRPOStats:
    """Statistics of one loss evaluation; every field but ``loss``, ``tokens`` and the ratio's range
    is a mean over the ``tokens`` masked tokens (``merge_stats`` combines parts)."""

    loss: float
    clip_fraction: float
    kl_rollout_trainer_k3: float
    kl_rollout_trainer_k1: float
    tis_weight_mean: float
    tis_truncated_fraction: float
    tokens: int
    approx_kl: float = 0.0  # k3 of KL(old || new) on these tokens
    ratio_mean: float = 1.0
    ratio_std: float = 0.0
    ratio_min: float = 1.0
    ratio_max: float = 1.0
    kl_ref: float = 0.0  # k3 of KL(trainer || reference) on these tokens (0 without a reference)


def merge_stats(parts: list[GRPOStats]) -> GRPOStats:
    """The statistics of the union of disjoint parts (micro-batches of one update, or the updates of
    one pass over the batch): losses add (each part's loss is already its share of the total),
    means are weighted by tokens, the ratio's spread is pooled, its range is the outer range."""
    n = sum(p.tokens for p in parts)
    if n == 0:
        return GRPOStats(sum(p.loss for p in parts), 0.0, 0.0, 0.0, 0.0, 0.0, 0)
    means = ("clip_fraction", "kl_rollout_trainer_k3", "kl_rollout_trainer_k1", "tis_weight_mean",
             "tis_truncated_fraction", "approx_kl", "ratio_mean", "kl_ref")
    out = {k: sum(getattr(p, k) * p.tokens for p in parts) / n for k in means}
    second = sum((p.ratio_std ** 2 + p.ratio_mean ** 2) * p.tokens for p in parts) / n
    live = [p for p in parts if p.tokens]
    out.update(loss=sum(p.loss for p in parts), tokens=n, ratio_std=math.sqrt(max(second - out["ratio_mean"] ** 2, 0.0)),
               ratio_min=min(p.ratio_min for p in live), ratio_max=max(p.ratio_max for p in live))
    return GRPOStats(**{f.name: out[f.name] for f in fields(GRPOStats)})


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, logp_rollout: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps_low: float = 0.2, clip_eps_high: float = 0.28,
              tis_cap: float | None = 2.0, weights: torch.Tensor | None = None, logp_ref: torch.Tensor | None = None,
              kl_coef: float = 0.0, is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, GRPOStats]:
    """Token tensors ``[B, T]``; advantages ``[B]`` (per sequence) or ``[B, T]``; mask ``[B, T]`` of
    generated (trained) tokens; ``weights`` ``[B, T]``: the aggregation weights (``loss_weights``;
    default token-mean over ``mask``); ``logp_ref`` ``[B, T]``: the frozen reference's log-probabilities
    (``kl_ref`` is reported whenever it is given; the penalty ``kl_coef * k3_ref`` joins the loss when
    ``kl_coef`` > 0, which needs it); ``is_weights`` ``[B, T]``: the importance weights of another
    rollout correction (``k3core.rl.correction``; detached) in place of token TIS ``min(rho, tis_cap)``,
    with its rejected tokens already out of ``mask``. Returns the scalar loss ``sum(loss_tok * weights)`` and detached
    statistics (means over the masked tokens)."""
    if not (logp.shape == logp_old.shape == logp_rollout.shape == mask.shape):
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, "
                         f"logp_rollout {tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}")
    if kl_coef and logp_ref is None:
        raise ValueError(f"kl_coef {kl_coef} needs the reference's log-probabilities (logp_ref); "
                         "compute them with the reference stage, or set kl_coef 0")
    if logp_ref is not None and logp_ref.shape != mask.shape:
        raise ValueError(f"logp_ref has shape {tuple(logp_ref.shape)}, the mask {tuple(mask.shape)}")
    m = mask.float()
    n = m.sum().clamp_min(1.0)
    A = advantages.float()
    if A.dim() == 1:
        A = A.unsqueeze(1).expand_as(logp)
    logp_old = logp_old.detach().float()
    logp_rollout = logp_rollout.detach().float()
    ratio = torch.exp(logp.float() - logp_old)
    unclipped = ratio * A
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * A
    log_rho = (logp_old - logp_rollout).masked_fill(m == 0, 0.0)
    rho = torch.exp(log_rho)
    if is_weights is not None:
        if is_weights.shape != mask.shape:
            raise ValueError(f"is_weights have shape {tuple(is_weights.shape)}, the mask {tuple(mask.shape)}")
        w = is_weights.detach().float()
    else:
        w = rho if tis_cap is None else rho.clamp(max=tis_cap)
    per_tok = -w * torch.minimum(unclipped, clipped)
    kl_tok = None
    if logp_ref is not None:
        d = (logp_ref.detach().float() - logp.float()).masked_fill(m == 0, 0.0)  # log(q / p); 0 off the mask
        kl_tok = torch.exp(d) - d - 1.0
        if kl_coef:
            per_tok = per_tok + kl_coef * kl_tok
    if weights is None:
        weights = loss_weights(mask)
    elif weights.shape != mask.shape:
        raise ValueError(f"weights have shape {tuple(weights.shape)}, the mask {tuple(mask.shape)}")
    loss = (per_tok * weights.to(per_tok.dtype) * m).sum()
    with torch.no_grad():
        clip_frac = (((clipped < unclipped).float()) * m).sum() / n
        k3 = ((rho - 1.0 - log_rho) * m).sum() / n
        k1 = ((-log_rho) * m).sum() / n
        trunc = (((rho > tis_cap).float() if tis_cap is not None else torch.zeros_like(rho)) * m).sum() / n
        r = ratio.detach()
        log_r = (logp.detach().float() - logp_old).masked_fill(m == 0, 0.0)
        approx_kl = ((r - 1.0 - log_r) * m).sum() / n
        r_mean = (r * m).sum() / n
        r_std = ((((r - r_mean) ** 2) * m).sum() / n).sqrt()
        on = m > 0
        # one device -> host read for every statistic (each float() would wait for the GPU queue):
        # stacked in fp64, which holds each fp32 value exactly, as float() would return it
        values = {"loss": loss, "clip_fraction": clip_frac, "kl_rollout_trainer_k3": k3, "kl_rollout_trainer_k1": k1,
                  "tis_weight_mean": (w * m).sum() / n, "tis_truncated_fraction": trunc, "tokens": m.sum(),
                  "approx_kl": approx_kl, "ratio_mean": r_mean, "ratio_std": r_std,
                  "ratio_min": r.masked_fill(~on, math.inf).min(), "ratio_max": r.masked_fill(~on, -math.inf).max(),
                  "kl_ref": (kl_tok.detach() * m).sum() / n if kl_tok is not None else torch.zeros_like(n),
                  "n_on": on.sum()}
        got = dict(zip(values, torch.stack([v.detach().double() for v in values.values()]).tolist()))
    any_on = got.pop("n_on") > 0
    if not any_on:
        got.update(ratio_mean=1.0, ratio_min=1.0, ratio_max=1.0)
    stats = GRPOStats(**{**got, "tokens": int(got["tokens"])})
    return loss, stats


# Row chunks of ``mean_entropy`` hold at most this many elements (fp32: 256 MiB per temporary).
ENTROPY_CHUNK_ELEMENTS = 1 << 26


def mean_entropy(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean token entropy (nats) ``-sum_v p log p`` over the masked positions of the distributions
    given by log-probabilities ``logp`` ``[B, T, V]`` (a ``log_softmax`` output), mask ``[B, T]`` ->
    0-d fp32 tensor on ``logp``'s device: no host read, no gradient. Computed over row chunks of at
    most ``ENTROPY_CHUNK_ELEMENTS``, so its temporaries are two ``[rows, V]`` tensors, not two
    ``[B, T, V]``; each row's sum is the same as over the whole tensor."""
    with torch.no_grad():
        rows = logp.reshape(-1, logp.shape[-1])
        step = max(1, ENTROPY_CHUNK_ELEMENTS // max(rows.shape[1], 1))
        parts = [-(c.exp() * c).sum(-1) for c in (c.float() for c in rows.split(step))]
        ent = (torch.cat(parts) if parts else rows.new_zeros(0, dtype=torch.float32)).view(logp.shape[:-1])
        m = mask.float()
        return (ent * m).sum() / m.sum().clamp_min(1.0)
