"""The loss mask of multi-turn sequences: the train step trains only the output tokens the policy
sampled (mask 1), and the environment's tokens between turns (tool results, user turns: mask 0) are
context only. Checked against a naive reference (one plain forward of the whole sequence, the
on-policy GRPO loss over the masked-in positions, autograd), in both micro-batch layouts; and shown
blind to what sits at masked positions: their rollout log-probabilities change nothing, with two
PPO epochs (logp_old from an extra pass) and the KL penalty on."""

import copy

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.train import RLSequence, grpo_train_step
from k3core.settings import GRPOSettings

CONFIG = K3Config.preset("tiny")
PAD = CONFIG.pad_token_id
PROMPT = [CONFIG.bos_token_id, 10, 11, 12]
# turn 1 sampled (3), a tool result (4, context), turn 2 sampled (2), a user turn (2), turn 3 sampled (1)
OUTPUT = [40, 41, 42, 90, 91, 92, 93, 50, 51, 95, 96, 60]
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1]
ADVANTAGE = 0.7


def _model(seed=0):
    torch.manual_seed(seed)
    m = K3ForCausalLM(CONFIG)
    m.reset_parameters(seed)
    return m


def _own_logprobs(model, ids):
    """The model's log-probability of each next token of ``ids`` (one plain forward, fp32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits.float()
    return torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def _grads(model, seqs, **settings):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradients stay readable after the (no-op) step
    cfg = GRPOSettings(routing_replay=False, lr_warmup_steps=0, max_grad_norm=1e6, **settings)
    metrics = grpo_train_step(model, opt, seqs, cfg, PAD)
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_masked_step_equals_the_naive_loss_over_sampled_tokens(packing):
    model = _model()
    ids = PROMPT + OUTPUT
    own = _own_logprobs(model, ids)[len(PROMPT) - 1:]
    seq = RLSequence(PROMPT, OUTPUT, own.tolist(), ADVANTAGE, loss_mask=MASK)  # on-policy: TIS weights are 1
    metrics, got = _grads(copy.deepcopy(model), [seq], packing=packing)

    ref = copy.deepcopy(model)
    ref.zero_grad()
    logits = ref(torch.tensor([ids[:-1]])).logits.float()
    logp = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    sampled = logp[len(PROMPT) - 1:][torch.tensor(MASK, dtype=torch.bool)]
    ratio = torch.exp(sampled - sampled.detach())
    (-(ratio * ADVANTAGE).sum() / sum(MASK)).backward()  # token-mean over the sampled tokens only
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    assert metrics["tokens"] == sum(MASK) and metrics["loss"] == pytest.approx(-ADVANTAGE, rel=1e-5)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)
    # the embedding row of a token that occurs only at masked positions still gets a gradient (it is context)
    assert float(got["model.embed_tokens.weight"][91].abs().max()) > 0


def test_what_sits_at_masked_positions_changes_nothing():
    model = _model(1)
    ids = PROMPT + OUTPUT
    own = _own_logprobs(model, ids)[len(PROMPT) - 1:]
    rollout = (own + 0.05 * torch.randn(len(OUTPUT), generator=torch.Generator().manual_seed(3))).tolist()
    ref_lps = (own[torch.tensor(MASK, dtype=torch.bool)] - 0.1).tolist()  # per sampled token
    base = RLSequence(PROMPT, OUTPUT, rollout, ADVANTAGE, ref_logprobs=ref_lps, loss_mask=MASK)
    noisy = copy.deepcopy(base)
    noisy.rollout_logprobs = [lp if m else -50.0 for lp, m in zip(rollout, MASK)]
    other = RLSequence(PROMPT[:2], [40, 41, 42], None, -0.3)  # a single-turn sequence beside it
    settings = dict(ppo_epochs=2, kl_coef=0.1, packing=True)
    other.ref_logprobs = [-1.0, -1.0, -1.0]
    m1, g1 = _grads(copy.deepcopy(model), [base, other], **settings)
    m2, g2 = _grads(copy.deepcopy(model), [noisy, other], **settings)
    assert m1["loss"] == m2["loss"] and m1["tokens"] == sum(MASK) + 3
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n


@pytest.mark.parametrize("mask, says", [([0] * len(OUTPUT), "at least one 1"), ([1, 0], "each of its 12 output"),
                                        ([2] + MASK[1:], "must be 0/1")])
def test_bad_masks_are_refused(mask, says):
    with pytest.raises(ValueError, match=says):
        _grads(_model(), [RLSequence(PROMPT, OUTPUT, None, 1.0, loss_mask=mask)])
