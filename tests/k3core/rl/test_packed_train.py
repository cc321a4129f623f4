"""The train step in the packed layout against the padded one, unsplit.

Reference: one padded ``[B, L]`` forward of the whole minibatch with the rollout's experts forced,
the GRPO loss with the minibatch's weights, autograd. The packed step (``GRPOSettings.packing``) runs
the same minibatch as several packed micro-batches (first-fit decreasing under a real-token budget)
whose gradients accumulate; the gradient it hands the optimizer must be the reference's up to fp32
summation order. ``pack_varlen`` and the packed micro-batching are checked against values written out
by hand.
"""

import random

import pytest
import torch

from k3core.config import K3Config
from k3core.rl import train as tr
from k3core.rl.grpo import grpo_loss, loss_weights
from k3core.settings import GRPOSettings
from tests.k3core.rl.test_train_step import _model, _routing  # the same seeded tiny model and routing

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = K3Config.preset("tiny")
PAD = TINY.pad_token_id
N_MOE, K, E = len(TINY.moe_layers), TINY.num_experts_per_token, TINY.num_experts


def _batch(n=7, seed=0):
    """Mixed lengths (inputs of 2 to 22 positions), seeded tokens, rollout and reference logprobs,
    advantages and routing."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        p = [256] + torch.randint(0, 256, (1 + (i * 5) % 7,), generator=g).tolist()
        o = torch.randint(0, 256, (1 + (i * 7) % 13,), generator=g).tolist()
        roll = (-5.0 + torch.rand(len(o), generator=g)).tolist()
        ref = (-5.0 + torch.rand(len(o), generator=g)).tolist()
        adv = float(torch.randn(1, generator=g))
        seqs.append(tr.RLSequence(p, o, roll, adv, _routing(len(p) + len(o) - 1, 10 + i), ref))
    return seqs


class _Recording(torch.optim.SGD):
    """SGD that keeps the gradients it is handed at every step."""

    def __init__(self, model, lr):
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        super().__init__([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.grads = []

    def step(self, closure=None):
        ps = self.param_groups[0]["params"]
        self.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in zip(self.names, ps)})
        return super().step(closure)


# ------------------------------------------------------------------------------------- the layout

def test_pack_varlen_exact_tensors():
    ra, rb = _routing(6, 1), _routing(7, 2)
    seqs = [tr.RLSequence([256, 72, 105], [33, 10, 257, 5], [-0.1, -0.2, -0.3, -0.4], 1.5, ra, [-1, -2, -3, -4.0]),
            tr.RLSequence([256, 87, 104, 121, 63], [66, 101, 257], [-1.5, -2.5, -3.5], -0.5, rb, [-5, -6, -7.0])]
    b = tr.pack_varlen(seqs, with_routing=True)
    assert torch.equal(b["input_ids"], torch.tensor([[256, 72, 105, 33, 10, 257, 256, 87, 104, 121, 63, 66, 101]]))
    assert torch.equal(b["targets"], torch.tensor([[72, 105, 33, 10, 257, 5, 87, 104, 121, 63, 66, 101, 257]]))
    assert b["cu_seqlens"].tolist() == [0, 6, 13] and b["cu_seqlens"].dtype == torch.int32
    assert b["seq_ids"].tolist() == [[0] * 6 + [1] * 7]
    assert bool(b["valid"].all()) and b["valid"].shape == (1, 13)
    assert b["gen_mask"].int().tolist() == [[0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]]
    torch.testing.assert_close(b["rollout_logprobs"], torch.tensor(
        [[0, 0, -0.1, -0.2, -0.3, -0.4, 0, 0, 0, 0, -1.5, -2.5, -3.5]]), rtol=0, atol=0)
    torch.testing.assert_close(b["ref_logprobs"], torch.tensor(
        [[0, 0, -1, -2, -3, -4, 0, 0, 0, 0, -5, -6, -7.0]]), rtol=0, atol=0)
    torch.testing.assert_close(b["advantages"], torch.tensor([[1.5] * 6 + [-0.5] * 7]), rtol=0, atol=0)
    assert b["routing"].shape == (1, 13, N_MOE, K) and torch.equal(b["routing"][0], torch.cat([ra, rb]))
    with pytest.raises(ValueError, match="routing replay: sequence 1"):
        tr.pack_varlen([seqs[0], tr.RLSequence([256], [1, 2], None, 0.0, _routing(5, 3), [-1.0, -1.0])],
                       with_routing=True)
    with pytest.raises(ValueError, match="sequence 1: None reference logprobs"):
        tr.pack_varlen([seqs[0], tr.RLSequence([256], [1, 2])])
    with pytest.raises(ValueError, match="empty completion"):
        tr.pack_varlen([tr.RLSequence([256], [])])


def test_packed_micro_batches_are_first_fit_decreasing_on_real_tokens():
    mb = tr.micro_batches
    lengths = [5, 9, 3, 9, 2]
    # longest first (ties by index): 1, 3, 0, 2, 4; each joins the first micro-batch with room
    assert mb(lengths, 12, packed=True) == [[1, 2], [3, 4], [0]]
    assert mb(lengths, 28, packed=True) == [[1, 3, 0, 2, 4]]
    assert mb(lengths, 4, packed=True) == [[1], [3], [0], [2], [4]]  # longer than the budget: alone
    assert mb(lengths, 0, packed=True) == [[0, 1, 2, 3, 4]]
    assert mb([], 8, packed=True) == []
    rng = random.Random(0)
    for _ in range(50):
        ls = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(1, 120)
        got = mb(ls, budget, packed=True)
        assert got == mb(ls, budget, packed=True)  # deterministic
        assert sorted(i for b in got for i in b) == list(range(len(ls)))
        assert all(sum(ls[i] for i in b) <= budget or len(b) == 1 for b in got)
        # never more micro-batches than the padded split of the same budget
        assert len(got) <= len(mb(ls, budget))


def test_loss_weights_of_a_packed_row_equal_the_padded_rows():
    seqs = _batch()
    pad, packed = tr.pack_sequences(seqs, PAD), tr.pack_varlen(seqs)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-sum"):
        a = loss_weights(pad["gen_mask"], agg, norm=13)
        b = loss_weights(packed["gen_mask"], agg, norm=13, seq_ids=packed["seq_ids"])
        torch.testing.assert_close(b[packed["gen_mask"]], a[pad["gen_mask"]], rtol=1e-7, atol=0)


# ----------------------------------------------------------------------------- gradients and logps

def _reference_grads(model, seqs, agg, temperature, kl_coef, norm, forced=True):
    """The minibatch as one padded batch: forward, loss with the minibatch's weights, autograd."""
    b = tr.pack_sequences(seqs, PAD, with_routing=forced)
    out = model(b["input_ids"], b["valid"], forced_routing=b["routing"])
    logp = torch.log_softmax(out.logits.float() / temperature, -1).gather(-1, b["targets"].unsqueeze(-1)).squeeze(-1)
    mask = b["gen_mask"]
    w = loss_weights(mask, agg, norm=norm)
    loss, _ = grpo_loss(logp, logp.detach(), b["rollout_logprobs"], b["advantages"], mask, 0.2, 0.28, 2.0,
                        weights=w, logp_ref=b["ref_logprobs"], kl_coef=kl_coef)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return float(loss.detach()), dict(zip(names, grads))


@pytest.mark.parametrize("agg,temperature,kl_coef", [("token-mean", 1.0, 0.0), ("seq-mean-token-mean", 0.7, 0.0),
                                                     ("seq-sum", 1.0, 0.5)])
def test_packed_micro_batched_gradient_equals_the_unpacked_single_batch(agg, temperature, kl_coef):
    seqs = _batch()
    norm = 13.0
    m = _model()
    want_loss, want = _reference_grads(m, seqs, agg, temperature, kl_coef, norm)
    opt = _Recording(m, lr=0.0)
    cfg = GRPOSettings(routing_replay=True, packing=True, micro_batch_tokens=24, loss_aggregation=agg,
                       kl_coef=kl_coef, max_grad_norm=1e9)
    met = tr.grpo_train_step(m, opt, seqs, cfg, PAD, temperature=temperature, seq_sum_norm=norm)
    lengths = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs]
    assert met["micro_batches"] == len(tr.micro_batches(lengths, 24, packed=True)) >= 3  # accumulation happens
    assert met["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    (got,) = opt.grads
    scale = max(float(g.abs().max()) for g in want.values() if g is not None)
    assert scale > 1e-2
    for n, g in want.items():
        if g is None or float(g.abs().max()) == 0:
            assert got[n] is None or float(got[n].abs().max()) <= 1e-6 * scale, n
            continue
        # fp32 summation order (other micro-batch sums, conv as a sum over lags, other KDA chunk
        # sizes): seen up to 5e-5 of a tensor's largest entry, on the AttnRes weights whose gradient
        # sums many cancelling terms. A wrong weight, a lost micro-batch or a leak moves it by O(1).
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=2e-4 * float(g.abs().max()), msg=lambda s: f"{n}: {s}")
    # the reference through the router's own experts is another gradient: the replayed routing is what counts
    _, free = _reference_grads(m, seqs, agg, temperature, kl_coef, norm, forced=False)
    w13 = "model.layers.1.block_sparse_moe.experts.w13"
    assert (free[w13] - want[w13]).abs().max() > 1e-3 * float(want[w13].abs().max())


def test_old_logprobs_packed_equal_padded_and_each_sequence_alone():
    seqs = _batch(seed=1)
    m = _model()
    packed = tr.old_logprobs(m, seqs, GRPOSettings(routing_replay=True, micro_batch_tokens=20), PAD, 0.8)
    padded = tr.old_logprobs(m, seqs, GRPOSettings(routing_replay=True, packing=False), PAD, 0.8)
    with torch.no_grad():
        for s, a, b in zip(seqs, packed, padded):
            x = torch.tensor(s.prompt_ids + s.output_ids)
            lp = torch.log_softmax(m(x[:-1].unsqueeze(0), forced_routing=s.routing.unsqueeze(0)).logits[0] / 0.8, -1)
            want = lp[len(s.prompt_ids) - 1:].gather(-1, x[len(s.prompt_ids):].unsqueeze(-1)).squeeze(-1)
            assert a.shape == b.shape == want.shape
            torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(b, want, rtol=1e-5, atol=1e-5)


def test_packed_and_padded_steps_agree_over_epochs_and_minibatches():
    """2 PPO epochs x 2 minibatches (logp_old once, before the first): packed micro-batches of 16
    real tokens against padded whole minibatches, the same seeded shuffle."""
    seqs = _batch(seed=2)
    runs = []
    for cfg in (GRPOSettings(routing_replay=True, packing=True, micro_batch_tokens=16, ppo_epochs=2, minibatches=2,
                             max_grad_norm=1e9),
                GRPOSettings(routing_replay=True, packing=False, micro_batch_tokens=0, ppo_epochs=2, minibatches=2,
                             max_grad_norm=1e9)):
        m = _model()
        torch.manual_seed(5)
        met = tr.grpo_train_step(m, torch.optim.SGD(m.parameters(), lr=2e-5), seqs, cfg, PAD)
        runs.append((m, met))
    (mp, a), (mq, b) = runs
    assert a["micro_batches"] > b["micro_batches"] == 4
    assert a["approx_kl_last"] > 1e-5  # later updates off-policy: logp_old (packed) is used
    for ua, ub in zip(a["per_update"], b["per_update"]):
        for k in ("loss", "grad_norm", "approx_kl", "ratio_mean", "ratio_min", "ratio_max"):
            assert ua[k] == pytest.approx(ub[k], rel=1e-3, abs=1e-6), k
    start = dict(_model().named_parameters())
    for (n, p), q in zip(mp.named_parameters(), mq.parameters()):
        step = float((q - start[n]).detach().abs().max())
        torch.testing.assert_close(p, q, rtol=0, atol=1e-4 * step + 1e-6, msg=lambda s: f"{n}: {s}")
