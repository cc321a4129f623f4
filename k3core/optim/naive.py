"""Plain references for ``k3core.optim``: whole tensors, no chunks, no streams, formulas written out.

Nothing used in training; tests hold the fast paths to these.

``noise_for`` and ``stochastic_round_to_bf16_reference``: the stochastic rounding of
``k3core.optim.stochastic_rounding`` (which says why and how) by index arithmetic and float64
comparison instead of table slices and bit tricks.

``ReferenceHostAdamW``: StreamedAdamW (``k3core.optim.streamed_adam``) as one loop. It keeps the same
host state (fp32 master, moments in ``moment_dtype``), rounds bf16 moments with the same noise and
the reference rounding above, and implements AdamW as torch.optim.AdamW documents it:

    g <- g * min(1, max_grad_norm / (||g||_2 + 1e-6))          (global norm over all gradients)
    t <- t + 1
    p <- p - lr * weight_decay * p
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

in fp32; device weights are the masters rounded to nearest in their own dtype.
"""

from __future__ import annotations

import math

import torch

from k3core.optim.stochastic_rounding import NOISE_TABLE_NUMEL, make_noise_table, noise_offset


def noise_for(table: torch.Tensor, offset: int, start: int, numel: int) -> torch.Tensor:
    """The noise add_noise_ would use, gathered by explicit index arithmetic (reference path)."""
    idx = (offset + start + torch.arange(numel, dtype=torch.int64)) % NOISE_TABLE_NUMEL
    return table[idx]


def stochastic_round_to_bf16_reference(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Plain-arithmetic oracle for stochastic_round_to_bf16_: x fp32 [n], noise int [n] -> bf16 [n].

    Rounds |x| up to the next bf16 magnitude iff noise >= 2^16 * (1 - frac), where frac is how far
    |x| lies between its truncated bf16 value and the next one, computed in float64 (exact here).
    """
    x64 = x.double()
    trunc = (x.view(torch.int32) & -65536).view(torch.float32)  # drop the low 16 bits: toward zero
    up = (trunc.view(torch.int32) + 65536).view(torch.float32)  # next bf16 magnitude, same sign
    lo, hi = trunc.double().abs(), up.double().abs()
    frac = (x64.abs() - lo) / (hi - lo)
    round_up = noise.double() >= 65536.0 * (1.0 - frac)  # never for exact values: noise < 2^16
    return torch.where(round_up, up, trunc).to(torch.bfloat16)


class ReferenceHostAdamW:
    """One param group of plain (non-DTensor) parameters; same arguments as StreamedAdamW."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = None,
        moment_dtype: torch.dtype = torch.bfloat16,
        moment_rounding: str = "stochastic",
        seed: int = 0,
    ) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.max_grad_norm = max_grad_norm
        self.moment_dtype, self.moment_rounding, self.seed = moment_dtype, moment_rounding, seed
        self.noise = make_noise_table(seed)
        self.master = [p.detach().float().clone() for p in self.params]
        self.exp_avg = [torch.zeros(p.shape, dtype=moment_dtype) for p in self.params]
        self.exp_avg_sq = [torch.zeros(p.shape, dtype=moment_dtype) for p in self.params]
        self.steps = [0 for _ in self.params]

    def _store(self, x: torch.Tensor, index: int, moment: int) -> torch.Tensor:
        if self.moment_dtype == torch.float32:
            return x
        if self.moment_rounding == "nearest":
            return x.to(torch.bfloat16)
        offset = noise_offset(self.seed, index, self.steps[index], moment)
        noise = noise_for(self.noise, offset, 0, x.numel()).view(x.shape)
        return stochastic_round_to_bf16_reference(x.reshape(-1), noise.reshape(-1)).view(x.shape)

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = {i: self.params[i].grad.float() for i in live}
        if self.max_grad_norm is not None and live:
            norm = math.sqrt(sum(float(grads[i].square().sum()) for i in live))
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            grads = {i: g * coef for i, g in grads.items()}
        beta1, beta2 = self.betas
        for i in live:
            self.steps[i] += 1
            t, g, p = self.steps[i], grads[i], self.master[i]
            m = beta1 * self.exp_avg[i].float() + (1 - beta1) * g
            v = beta2 * self.exp_avg_sq[i].float() + (1 - beta2) * g * g
            p.mul_(1 - self.lr * self.weight_decay)
            m_hat = m / (1 - beta1**t)
            v_hat = v / (1 - beta2**t)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))
            self.exp_avg[i] = self._store(m, i, 0)
            self.exp_avg_sq[i] = self._store(v, i, 1)
            self.params[i].copy_(p)
