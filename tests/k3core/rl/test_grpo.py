"""GRPO loss, advantages, KL and IS weights against hand-computed values and closed forms."""

import math

import pytest
import torch

from k3core.rl.grpo import grpo_loss, group_advantages


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(r, 4)
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: uniform -> 0
    torch.testing.assert_close(a, torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def test_loss_hand_computed_example():
    # two sequences, two tokens each; second token of seq 2 is padding
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -2.0], [-0.1, -9.0]])
    roll = torch.tensor([[-1.2, -2.5], [-0.1, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, st = grpo_loss(logp, old, roll, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, tis_cap=2.0)
    # token by token: ratio, TIS weight min(exp(old - roll), 2), clipped surrogate
    r1 = math.exp(0.2)       # 1.2214 > 1.2 -> clipped for A=+1: min(1.2214, 1.2) = 1.2
    r2 = 1.0                 # ratio 1, w = min(exp(0.5), 2) = 1.6487
    r3 = math.exp(-0.4)      # 0.6703, A=-2: min(-1.3406, -1.6) = -1.6 (clipped at 0.8)
    terms = [-(1.0) * 1.2 * 1.0, -math.exp(0.5) * r2 * 1.0, -(1.0) * (0.8 * -2.0)]
    assert float(loss) == pytest.approx(sum(terms) / 3, rel=1e-6)
    assert st.clip_fraction == pytest.approx(2 / 3)
    assert st.tokens == 3
    # KL(rollout || trainer) on the rollout's samples: k3 = rho - 1 - log rho, rho = p_t / p_r
    rhos = [1.0, math.exp(0.5), 1.0]
    assert st.kl_rollout_trainer_k3 == pytest.approx(sum(x - 1 - math.log(x) for x in rhos) / 3, rel=1e-6)
    assert st.kl_rollout_trainer_k1 == pytest.approx(-0.5 / 3, rel=1e-6)
    assert st.tis_weight_mean == pytest.approx((1 + math.exp(0.5) + 1) / 3, rel=1e-6)
    loss.backward()
    # gradient only through unclipped tokens: d/dlogp of -w*ratio*A = -w*ratio*A
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -math.exp(0.5) / 3], [0.0, 0.0]]))


def test_tis_truncation_and_k3_closed_form():
    old = torch.tensor([[0.0, -1.0]])
    roll = torch.tensor([[-3.0, -1.0]])  # rho = e^3 > cap
    logp = old.clone().requires_grad_(True)
    _, st = grpo_loss(logp, old, roll, torch.tensor([1.0]), torch.ones(1, 2), tis_cap=2.0)
    assert st.tis_truncated_fraction == pytest.approx(0.5)
    assert st.tis_weight_mean == pytest.approx((2.0 + 1.0) / 2)
    assert st.kl_rollout_trainer_k3 == pytest.approx((math.exp(3) - 1 - 3) / 2, rel=1e-6)


def test_k3_is_unbiased_kl_estimate():
    """E_{x~p_r}[rho - 1 - log rho] = KL(p_r || p_t), checked on a categorical by sampling."""
    torch.manual_seed(0)
    pr = torch.softmax(torch.randn(6), 0)
    pt = torch.softmax(torch.randn(6), 0)
    x = torch.multinomial(pr, 200000, replacement=True)
    lr, lt = pr.log()[x].unsqueeze(0), pt.log()[x].unsqueeze(0)
    _, st = grpo_loss(lt.clone().requires_grad_(True), lt, lr, torch.zeros(1), torch.ones_like(lt), tis_cap=None)
    kl = float((pr * (pr.log() - pt.log())).sum())
    assert st.kl_rollout_trainer_k3 == pytest.approx(kl, rel=0.03)
    assert st.kl_rollout_trainer_k1 == pytest.approx(kl, rel=0.03)
