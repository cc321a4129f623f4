"""GRPO loss, advantages, KL and IS weights against hand-computed values and closed forms."""

import math

import pytest
import torch

from k3core.rl.grpo import group_advantages, grpo_loss, loss_weights, merge_stats, uniform_groups


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(r, 4)
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: uniform -> 0
    torch.testing.assert_close(a, torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def test_group_advantages_unscaled_and_uniform_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 0.6, 0.5, 0.5, 0.5, 0.5])
    # scale off (Dr. GRPO): reward minus the group mean only; group 1 mean 0.4
    torch.testing.assert_close(group_advantages(r, 4, scale=False),
                               torch.tensor([0.6, -0.4, -0.4, 0.2, 0, 0, 0, 0]), atol=1e-6, rtol=0)
    # scaled: divided by the population std sqrt(mean((r - 0.4)^2)) = sqrt(0.56 / 4)
    std = math.sqrt((0.36 + 0.16 + 0.16 + 0.04) / 4)
    torch.testing.assert_close(group_advantages(r, 4)[:4], torch.tensor([0.6, -0.4, -0.4, 0.2]) / (std + 1e-6))
    assert uniform_groups(r, 4).tolist() == [False, True]
    assert uniform_groups(torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0]), 2).tolist() == [True, True, False]


def test_loss_weights_follow_their_definitions():
    """Three sequences of 2, 3 and 1 generated tokens (6 in all)."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=torch.bool)
    m = mask.float()
    torch.testing.assert_close(loss_weights(mask, "token-mean"), m / 6)
    per_seq = torch.tensor([[1 / 2], [1 / 3], [1 / 1]]) / 3  # 1 / (n |y_i|)
    torch.testing.assert_close(loss_weights(mask, "seq-mean-token-mean"), m * per_seq)
    torch.testing.assert_close(loss_weights(mask, "seq-sum", norm=4), m / (3 * 4))  # 1 / (n C)
    # a micro-batch (rows 1-2) of a minibatch of 6 tokens and 3 sequences weighs its tokens as the whole does
    for mode in ("token-mean", "seq-mean-token-mean", "seq-sum"):
        whole = loss_weights(mask, mode, norm=4)
        part = loss_weights(mask[1:], mode, tokens=6, sequences=3, norm=4)
        torch.testing.assert_close(part, whole[1:])
    with pytest.raises(ValueError, match="seq-sum"):
        loss_weights(mask, "seq-sum")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        loss_weights(mask, "sum")


def test_merge_stats_equals_the_whole_batch():
    """grpo_loss on two parts of a batch (with the whole batch's weights) gives the whole batch's loss,
    gradient and statistics once merged: the algebra of micro-batch accumulation."""
    torch.manual_seed(0)
    B, T = 5, 4
    old = -torch.rand(B, T) * 3
    logp = (old + 0.4 * torch.randn(B, T)).requires_grad_(True)  # ratios spread around 1, some clipped
    roll = old + 0.3 * torch.randn(B, T)
    adv = torch.randn(B)
    mask = torch.rand(B, T) > 0.3
    mask[:, 0] = True
    w = loss_weights(mask, "seq-mean-token-mean")
    loss, whole = grpo_loss(logp, old, roll, adv, mask, weights=w)
    (g_whole,) = torch.autograd.grad(loss, logp)
    parts, grads = [], torch.zeros_like(logp)
    for rows in (slice(0, 2), slice(2, 5)):
        lp = logp.detach()[rows].clone().requires_grad_(True)
        part_loss, st = grpo_loss(lp, old[rows], roll[rows], adv[rows], mask[rows], weights=w[rows])
        part_loss.backward()
        grads[rows] = lp.grad
        parts.append(st)
    merged = merge_stats(parts)
    torch.testing.assert_close(grads, g_whole)
    assert 0 < whole.clip_fraction < 1 and whole.ratio_std > 0.1
    for f in ("loss", "clip_fraction", "kl_rollout_trainer_k3", "kl_rollout_trainer_k1", "tis_weight_mean",
              "tis_truncated_fraction", "approx_kl", "ratio_mean", "ratio_std", "ratio_min", "ratio_max"):
        assert getattr(merged, f) == pytest.approx(getattr(whole, f), rel=1e-5, abs=1e-7), f
    assert merged.tokens == whole.tokens == int(mask.sum())
    # the ratio's statistics by hand
    r = torch.exp(logp.detach() - old)[mask]
    assert whole.ratio_min == pytest.approx(float(r.min())) and whole.ratio_max == pytest.approx(float(r.max()))
    assert whole.ratio_std == pytest.approx(float(r.std(unbiased=False)), rel=1e-5)
    assert whole.approx_kl == pytest.approx(float((r - 1 - r.log()).mean()), rel=1e-5)


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
    assert r1 > 1.2 and r3 < 0.8  # both outside the clip range, on the side their advantage pushes
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


def test_kl_penalty_value_and_gradient_against_a_naive_loop():
    """loss_tok gains kl_coef * (exp(ref - logp) - (ref - logp) - 1); its gradient in logp is
    kl_coef * (1 - exp(ref - logp)) times the token's weight; padding contributes nothing."""
    torch.manual_seed(1)
    B, T, c = 3, 5, 0.7
    old = -torch.rand(B, T) * 3
    logp = (old + 0.3 * torch.randn(B, T)).requires_grad_(True)
    roll = old + 0.2 * torch.randn(B, T)
    ref = old + 0.5 * torch.randn(B, T)
    ref[0, 4] = 50.0  # a huge value on a padded position must not leak into the loss
    adv = torch.randn(B)
    mask = torch.ones(B, T)
    mask[0, 4] = mask[2, 3:] = 0.0
    base, st0 = grpo_loss(logp, old, roll, adv, mask)
    with_kl, st = grpo_loss(logp, old, roll, adv, mask, logp_ref=ref, kl_coef=c)
    n = int(mask.sum())
    k3 = [[math.exp(float(ref[b, t] - logp[b, t])) - float(ref[b, t] - logp[b, t]) - 1 for t in range(T)]
          for b in range(B)]
    penalty = sum(k3[b][t] for b in range(B) for t in range(T) if mask[b, t]) / n
    assert float(with_kl - base) == pytest.approx(c * penalty, rel=1e-5)
    assert st.kl_ref == pytest.approx(penalty, rel=1e-5) and st0.kl_ref == 0.0
    (g_base,) = torch.autograd.grad(base, logp)
    (g_kl,) = torch.autograd.grad(with_kl, logp)
    want = torch.tensor([[c * (1 - math.exp(float(ref[b, t] - logp[b, t]))) / n if mask[b, t] else 0.0
                          for t in range(T)] for b in range(B)])
    torch.testing.assert_close(g_kl - g_base, want, atol=1e-6, rtol=1e-5)
    # reported, but no penalty, with a zero coefficient; a coefficient without a reference is refused
    same, st_ref = grpo_loss(logp, old, roll, adv, mask, logp_ref=ref, kl_coef=0.0)
    assert float(same) == pytest.approx(float(base)) and st_ref.kl_ref == pytest.approx(penalty, rel=1e-5)
    with pytest.raises(ValueError, match="logp_ref"):
        grpo_loss(logp, old, roll, adv, mask, kl_coef=0.1)


def test_kl_penalty_is_exact_kl_of_trainer_to_reference_under_the_trainer():
    """Weighting each vocabulary item by its probability under the trainer (the expectation the
    samples estimate), the penalty is KL(p || q) = sum p log(p / q) in closed form, not the reverse
    KL; and zero when the trainer is the reference."""
    torch.manual_seed(2)
    p = torch.softmax(torch.randn(1, 9) * 2, -1)
    q = torch.softmax(torch.randn(1, 9) * 2, -1)
    lp = p.log().requires_grad_(True)
    zero = torch.zeros(1)
    loss, st = grpo_loss(lp, lp.detach(), lp.detach(), zero, torch.ones(1, 9), weights=p, logp_ref=q.log(), kl_coef=1.0)
    kl_pq = float((p * (p.log() - q.log())).sum())
    kl_qp = float((q * (q.log() - p.log())).sum())
    assert float(loss) == pytest.approx(kl_pq, rel=1e-5)
    assert abs(kl_pq - kl_qp) > 0.05  # the two directions differ here, so the check tells them apart
    same, st = grpo_loss(lp, lp.detach(), lp.detach(), zero, torch.ones(1, 9), weights=p, logp_ref=p.log(),
                         kl_coef=1.0)
    assert float(same) == pytest.approx(0.0, abs=1e-7) and st.kl_ref == pytest.approx(0.0, abs=1e-7)
