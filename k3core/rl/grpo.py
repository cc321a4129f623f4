"""GRPO with PPO-style clipping and truncated importance sampling (TIS) for the rollout/trainer
mismatch. Pure tensor math: no model, no I/O.

Three log-probabilities per generated token:
  ``logp``          the trainer's, with gradient (current parameters)
  ``logp_old``      the trainer's at rollout time, no gradient (equals ``logp`` on the first update)
  ``logp_rollout``  the rollout engine's (other kernels, MXFP4 experts)

  A_i      = (r_i - mean(r_group)) / (std(r_group) + eps)          group-normalised, population std
  ratio    = exp(logp - logp_old)
  w_tis    = min(exp(logp_old - logp_rollout), tis_cap)             detached: corrects the sampler
  loss_tok = -w_tis * min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
  loss     = sum(loss_tok * mask) / sum(mask)                        token-level (DAPO) aggregation
KL(rollout || trainer) is estimated on the rollout's own samples with k3 = (rho - 1) - log rho,
rho = p_trainer / p_rollout (unbiased, non-negative), and k1 = log p_rollout - log p_trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards ``[G * group_size]`` (groups contiguous) -> advantages, same shape, fp32."""
    r = rewards.float()
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, group_size)
    mean = g.mean(1, keepdim=True)
    std = g.std(1, unbiased=False, keepdim=True)
    return ((g - mean) / (std + eps)).view(-1)


@dataclass
class GRPOStats:
    loss: float
    clip_fraction: float
    kl_rollout_trainer_k3: float
    kl_rollout_trainer_k1: float
    tis_weight_mean: float
    tis_truncated_fraction: float
    tokens: int


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, logp_rollout: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps_low: float = 0.2, clip_eps_high: float = 0.28,
              tis_cap: float | None = 2.0) -> tuple[torch.Tensor, GRPOStats]:
    """Token tensors ``[B, T]``; advantages ``[B]`` (per sequence) or ``[B, T]``; mask ``[B, T]`` of
    generated (trained) tokens. Returns the scalar loss and detached statistics."""
    if not (logp.shape == logp_old.shape == logp_rollout.shape == mask.shape):
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, "
                         f"logp_rollout {tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}")
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
    w = rho if tis_cap is None else rho.clamp(max=tis_cap)
    per_tok = -w * torch.minimum(unclipped, clipped)
    loss = (per_tok * m).sum() / n
    with torch.no_grad():
        clip_frac = (((clipped < unclipped).float()) * m).sum() / n
        k3 = ((rho - 1.0 - log_rho) * m).sum() / n
        k1 = ((-log_rho) * m).sum() / n
        trunc = (((rho > tis_cap).float() if tis_cap is not None else torch.zeros_like(rho)) * m).sum() / n
        stats = GRPOStats(loss=float(loss), clip_fraction=float(clip_frac), kl_rollout_trainer_k3=float(k3),
                          kl_rollout_trainer_k1=float(k1), tis_weight_mean=float((w * m).sum() / n),
                          tis_truncated_fraction=float(trunc), tokens=int(m.sum()))
    return loss, stats


def masked_entropy(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean token entropy (nats) of ``softmax(logits)`` over masked positions; logits ``[B, T, V]``."""
    with torch.no_grad():
        lp = torch.log_softmax(logits.float(), -1)
        ent = -(lp.exp() * lp).sum(-1)
        m = mask.float()
        return float((ent * m).sum() / m.sum().clamp_min(1.0))
