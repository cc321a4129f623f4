"""The RL train step against a hand-computed two-sequence case.

``pack_sequences`` is checked against tensors written out by hand. ``grpo_train_step`` is checked
against an independent path: each sequence runs through the model alone and unpadded (no packing),
with its routing forced, the generated tokens' log-probabilities are read off by hand, the GRPO + TIS
loss is written here from its definition, and autograd of that loss gives the gradient. The step must
report that loss and move every parameter by ``-lr * gradient`` under plain SGD (scaled by the
clipping coefficient when the gradient norm exceeds ``max_grad_norm``).
"""

import math

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = K3Config.preset("tiny")
PAD = TINY.pad_token_id
N_MOE, K, E = len(TINY.moe_layers), TINY.num_experts_per_token, TINY.num_experts

# Two sequences of different lengths whose prompts differ in length too.
# A: prompt 3 + completion 4 -> 7 tokens, 6 input positions; B: prompt 5 + completion 3 -> 8 tokens, 7 positions.
PROMPT_A, OUT_A = [256, 72, 105], [33, 10, 257, 5]
PROMPT_B, OUT_B = [256, 87, 104, 121, 63], [66, 101, 257]
ADV_A, ADV_B = 1.5, -0.5
# rollout logprob = trainer logprob + delta, so the TIS ratio exp(logp_old - logp_rollout) = exp(-delta):
# e, 0.67, 1.22, 1 for A and 0.50, 3.67, 0.90 for B; with cap 2, two of seven tokens are truncated.
DELTA_A = [-1.0, 0.4, -0.2, 0.0]
DELTA_B = [0.7, -1.3, 0.1]


def _train():
    """Imported at test time: train.py's settings may move while the module is being edited."""
    import k3core.rl.train as train
    return train


def _step(model, optimizer, seqs, *, temperature, seq_sum_norm=None, **settings):
    """``grpo_train_step`` with routing replay and these GRPO settings, at the optimizer's own rate
    (no warm-up ramp: the references below take plain steps; the ramp has its own test)."""
    from k3core.settings import GRPOSettings

    settings["routing_replay"] = True
    settings.setdefault("lr_warmup_steps", 0)
    return _train().grpo_train_step(model, optimizer, seqs, GRPOSettings(**settings), PAD, temperature=temperature,
                                    seq_sum_norm=seq_sum_norm)


def _routing(n: int, seed: int) -> torch.Tensor:
    """[n, N_MOE, K] distinct expert ids per (position, layer), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N_MOE)]) for _ in range(n)])


def _model(seed: int = 0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):  # non-trivial AttnRes mixing
                p.normal_(0, 0.5)
        m.lm_head.weight.mul_(10)  # peakier distributions than the near-uniform init: larger gradients
    return m.float()


# ---------------------------------------------------------------------------------------- packing

def test_pack_sequences_exact_tensors():
    tr = _train()
    ra, rb = _routing(6, 1), _routing(7, 2)
    seqs = [tr.RLSequence(PROMPT_A, OUT_A, [-0.1, -0.2, -0.3, -0.4], ADV_A, ra),
            tr.RLSequence(PROMPT_B, OUT_B, [-1.5, -2.5, -3.5], ADV_B, rb)]
    b = tr.pack_sequences(seqs, PAD, with_routing=True)
    P = PAD
    # L = max(7, 8) - 1 = 7; inputs seq[:-1], targets seq[1:], right-padded
    assert torch.equal(b["input_ids"], torch.tensor([[256, 72, 105, 33, 10, 257, P],
                                                     [256, 87, 104, 121, 63, 66, 101]]))
    assert b["input_ids"].dtype == torch.long
    assert torch.equal(b["targets"][b["valid"]], torch.tensor([72, 105, 33, 10, 257, 5,
                                                               87, 104, 121, 63, 66, 101, 257]))
    assert torch.equal(b["targets"][0, :6], torch.tensor([72, 105, 33, 10, 257, 5]))
    assert 0 <= int(b["targets"][0, 6]) < TINY.vocab_size  # padding target: any in-vocabulary id
    assert torch.equal(b["valid"], torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool))
    # generated-token targets only: positions p-1 .. n-1 (A: 2..5, B: 4..6)
    assert torch.equal(b["gen_mask"], torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool))
    # the masked targets are exactly the completions
    assert b["targets"][0][b["gen_mask"][0]].tolist() == OUT_A
    assert b["targets"][1][b["gen_mask"][1]].tolist() == OUT_B
    torch.testing.assert_close(b["rollout_logprobs"],
                               torch.tensor([[0, 0, -0.1, -0.2, -0.3, -0.4, 0], [0, 0, 0, 0, -1.5, -2.5, -3.5]]),
                               rtol=0, atol=0)
    assert b["rollout_logprobs"].dtype == torch.float32
    torch.testing.assert_close(b["advantages"], torch.tensor([ADV_A, ADV_B]), rtol=0, atol=0)
    r = b["routing"]
    assert r.shape == (2, 7, N_MOE, K) and r.dtype == torch.long
    assert torch.equal(r[0, :6], ra) and torch.equal(r[1], rb)
    pad_rows = r[0, 6]  # padding: any valid routing (in range, distinct ids), the forward range-checks it
    assert int(pad_rows.min()) >= 0 and int(pad_rows.max()) < E
    assert all(len(set(row.tolist())) == K for row in pad_rows)


def test_pack_sequences_without_logprobs_or_routing():
    tr = _train()
    b = tr.pack_sequences([tr.RLSequence(PROMPT_A, OUT_A), tr.RLSequence(PROMPT_B, OUT_B)], PAD)
    assert b["routing"] is None
    assert torch.equal(b["rollout_logprobs"], torch.zeros(2, 7))
    assert torch.equal(b["advantages"], torch.zeros(2))
    assert int(b["gen_mask"].sum()) == len(OUT_A) + len(OUT_B)


def test_pack_sequences_errors():
    tr = _train()
    good = tr.RLSequence(PROMPT_A, OUT_A, [-1.0] * 4, 1.0, _routing(6, 1))
    with pytest.raises(ValueError, match="empty completion"):
        tr.pack_sequences([good, tr.RLSequence(PROMPT_B, [])], PAD)
    with pytest.raises(ValueError, match="empty batch"):
        tr.pack_sequences([], PAD)
    with pytest.raises(ValueError, match=r"sequence 1: 2 rollout logprobs for 3 tokens"):
        tr.pack_sequences([good, tr.RLSequence(PROMPT_B, OUT_B, [-1.0, -1.0])], PAD)
    with pytest.raises(ValueError, match=r"routing replay: sequence 1 has routing \(6, 3, 2\), needs 7 positions"):
        tr.pack_sequences([good, tr.RLSequence(PROMPT_B, OUT_B, [-1.0] * 3, 0.0, _routing(6, 2))], PAD,
                          with_routing=True)
    with pytest.raises(ValueError, match=r"routing replay: sequence 1 has routing None, needs 7 positions"):
        tr.pack_sequences([good, tr.RLSequence(PROMPT_B, OUT_B, [-1.0] * 3)], PAD, with_routing=True)


def test_pack_sequences_missing_routing_on_first_sequence():
    tr = _train()
    with pytest.raises(ValueError, match="routing replay: sequence 0"):
        tr.pack_sequences([tr.RLSequence(PROMPT_A, OUT_A), tr.RLSequence(PROMPT_B, OUT_B, None, 0.0, _routing(7, 2))],
                          PAD, with_routing=True)


def test_pack_sequences_refuses_an_empty_prompt():
    tr = _train()
    with pytest.raises(ValueError, match="prompt"):
        tr.pack_sequences([tr.RLSequence([], OUT_A), tr.RLSequence(PROMPT_B, OUT_B)], PAD)


# ---------------------------------------------------------------------------- the reference path

def _forced_alone(model, prompt, out, routing):
    """One sequence alone, unpadded, no attention mask, routing forced -> logits [n, V]."""
    x = torch.tensor((prompt + out)[:-1]).unsqueeze(0)
    o = model(x, forced_routing=routing.unsqueeze(0), return_routing=True)
    assert torch.equal(o.routing[0], routing)  # the forward reports the experts it used
    return o.logits[0]


def _generated(logits, prompt, out, temperature):
    """log p(out[j]) read at position len(prompt) - 1 + j (the position whose next token is out[j]),
    and the entropy of the tempered distribution at those positions."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    pos = [len(prompt) - 1 + j for j in range(len(out))]
    logp = torch.stack([lp[i, tok] for i, tok in zip(pos, out)])
    entropy = torch.stack([-(lp[i].exp() * lp[i]).sum() for i in pos]).detach()
    return logp, entropy


def _agg_weights(agg, norm=None):
    """The weight of each token of A and of B in the batch loss, from the definitions: token-mean
    1 / #tokens (7); seq-mean-token-mean 1 / (#sequences * |completion|); seq-sum 1 / (#sequences * C)."""
    la, lb = len(OUT_A), len(OUT_B)
    return {"token-mean": (1 / (la + lb), 1 / (la + lb)), "seq-mean-token-mean": (1 / (2 * la), 1 / (2 * lb)),
            "seq-sum": (1 / (2 * norm), 1 / (2 * norm)) if norm else None}[agg]


def _reference_loss(logps, rollouts, advs, eps_low, eps_high, cap, weights=(1 / 7, 1 / 7)):
    """GRPO with PPO clipping and TIS, by default token-mean over all generated tokens of the batch (DAPO):
    ratio = exp(logp - logp_old), logp_old = logp detached (first, on-policy update);
    w = min(exp(logp_old - logp_rollout), cap); loss = -sum_seq weight_seq * sum_tokens w * min(ratio A, clip(ratio) A)."""
    total = 0.0
    for logp, roll, a, k in zip(logps, rollouts, advs, weights):
        old = logp.detach()
        ratio = torch.exp(logp - old)
        w = torch.exp(old - roll)
        if cap is not None:
            w = torch.clamp(w, max=cap)
        surrogate = torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
        total = total + k * (-(w * surrogate)).sum()
    return total


def test_forced_routing_is_honoured():
    """Forcing the router's own choice reproduces the free forward; forcing other experts changes the logits."""
    m = _model()
    for prompt, out, seed in ((PROMPT_A, OUT_A, 1), (PROMPT_B, OUT_B, 2)):
        x = torch.tensor(prompt + out[:-1]).unsqueeze(0)
        free = m(x, return_routing=True)
        own = m(x, forced_routing=free.routing, return_routing=True)
        torch.testing.assert_close(own.logits, free.logits)
        forced = _routing(x.shape[1], seed)
        assert not torch.equal(forced.sort(-1).values, free.routing[0].sort(-1).values)
        logits = _forced_alone(m, prompt, out, forced)
        assert (logits - free.logits[0]).abs().max() > 1e-3


def _run_case(max_grad_norm_factor, temperature, lr=1.0, cap=2.0, eps=(0.2, 0.28), agg="token-mean", micro=0,
              norm=None, packing=True):
    """Reference gradient and loss, then one grpo_train_step on the same model (loss aggregation ``agg``,
    micro-batches of ``micro`` tokens, seq-sum constant ``norm``, packed or padded micro-batches);
    returns everything to compare."""
    tr = _train()
    m = _model()
    ra, rb = _routing(len(PROMPT_A) + len(OUT_A) - 1, 1), _routing(len(PROMPT_B) + len(OUT_B) - 1, 2)
    m.train()
    (lp_a, ent_a), (lp_b, ent_b) = (_generated(_forced_alone(m, PROMPT_A, OUT_A, ra), PROMPT_A, OUT_A, temperature),
                                    _generated(_forced_alone(m, PROMPT_B, OUT_B, rb), PROMPT_B, OUT_B, temperature))
    logps, entropy = [lp_a, lp_b], float(torch.cat([ent_a, ent_b]).mean())
    rollouts = [logps[0].detach() + torch.tensor(DELTA_A), logps[1].detach() + torch.tensor(DELTA_B)]
    advs = [ADV_A, ADV_B]
    weights = _agg_weights(agg, norm)
    loss = _reference_loss(logps, rollouts, advs, eps[0], eps[1], cap, weights)
    # layer 0's attention AttnRes mixes nothing (frozen, requires_grad False): it must not move
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    params = [p for p in m.parameters() if p.requires_grad]
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    # on the single on-policy update ratio == 1, inside the clip range: d loss = -sum weight w A d logp
    ws = [torch.clamp(torch.exp(-torch.tensor(d)), max=cap) for d in (DELTA_A, DELTA_B)]
    pg = -sum(k * (w * a * lp).sum() for w, a, lp, k in zip(ws, advs, logps, weights))
    grads_pg = torch.autograd.grad(pg, params, allow_unused=True)
    for n, g, h in zip(names, grads, grads_pg):
        assert (g is None) == (h is None), n
        if g is not None:
            torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-5 * float(h.abs().max()), msg=lambda s: f"{n}: {s}")
    total_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
    max_norm = total_norm * max_grad_norm_factor
    before = {n: p.detach().clone() for n, p in m.named_parameters()}

    seqs = [tr.RLSequence(PROMPT_A, OUT_A, rollouts[0].tolist(), ADV_A, ra),
            tr.RLSequence(PROMPT_B, OUT_B, rollouts[1].tolist(), ADV_B, rb)]
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    metrics = _step(m, opt, seqs, temperature=temperature, clip_eps_low=eps[0], clip_eps_high=eps[1], tis_cap=cap,
                    max_grad_norm=max_norm, loss_aggregation=agg, micro_batch_tokens=micro, seq_sum_norm=norm,
                    packing=packing)
    after = {n: p.detach().clone() for n, p in m.named_parameters()}
    grads = dict(zip(names, grads), **{n: None for n in frozen})
    return dict(loss=float(loss.detach()), entropy=entropy, grads=grads, total_norm=total_norm, max_norm=max_norm,
                before=before, after=after, metrics=metrics, lr=lr)


def _check_update(r, coef):
    """after == before - lr * coef * grad for every parameter; unused parameters do not move."""
    lr = r["lr"]
    for n, g in r["grads"].items():
        step = r["before"][n] - r["after"][n]
        if g is None:
            assert torch.equal(step, torch.zeros_like(step)), f"{n} has no gradient but moved"
            continue
        expected = lr * coef * g
        # fp32: the packed and the unpacked forward differ in summation order (worst seen 3.5e-6 of the
        # tensor's largest step, 4e-7 on the LM head); before - after also loses ~1 ulp of |p| where the
        # step is small next to the weight (norm gains ~1 moving by ~3e-4). A wrong mask, a missing TIS
        # weight or other experts change the step by O(1) of itself.
        eps32 = torch.finfo(torch.float32).eps
        atol = 3e-5 * float(expected.abs().max()) + 4 * eps32 * float(r["before"][n].abs().max())
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=atol, msg=lambda s: f"{n}: {s}")


def _check_metrics(r):
    m = r["metrics"]
    assert m["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
    assert m["tokens"] == len(OUT_A) + len(OUT_B)
    assert m["grad_norm"] == pytest.approx(r["total_norm"], rel=1e-5)
    assert m["entropy"] == pytest.approx(r["entropy"], rel=1e-5)
    # k1 = mean(logp_rollout - logp_trainer) over generated tokens = mean(delta): pins the logprob slicing
    assert m["kl_rollout_trainer_k1"] == pytest.approx(sum(DELTA_A + DELTA_B) / 7, rel=1e-4, abs=1e-6)
    assert m["tis_truncated_fraction"] == pytest.approx(2 / 7)
    w = [min(math.exp(-d), 2.0) for d in DELTA_A + DELTA_B]
    assert m["tis_weight_mean"] == pytest.approx(sum(w) / 7, rel=1e-5)
    assert m["clip_fraction"] == 0.0


def test_grpo_train_step_matches_hand_computed_update():
    r = _run_case(max_grad_norm_factor=1e3, temperature=1.0)
    _check_metrics(r)
    # the loss is token-mean of -w * A (ratio 1 on the on-policy step): a number independent of the model
    w = [min(math.exp(-d), 2.0) for d in DELTA_A + DELTA_B]
    adv = [ADV_A] * len(OUT_A) + [ADV_B] * len(OUT_B)
    assert r["loss"] == pytest.approx(-sum(wi * ai for wi, ai in zip(w, adv)) / 7, rel=1e-5)
    # the highlighted parameters: the LM head, an embedding row of a prompt token, a router and the experts
    g = r["grads"]
    for n in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.1.block_sparse_moe.gate.weight",
              "model.layers.1.block_sparse_moe.experts.w13"):
        assert n in g and g[n] is not None and float(g[n].abs().max()) > 0, n
    assert float(g["model.embed_tokens.weight"][72].abs().max()) > 0
    assert float(g["model.embed_tokens.weight"][200].abs().max()) == 0  # a token in neither sequence
    _check_update(r, coef=1.0)


def test_grpo_train_step_clips_the_gradient_norm():
    r = _run_case(max_grad_norm_factor=0.25, temperature=0.7)
    _check_metrics(r)
    coef = r["max_norm"] / (r["total_norm"] + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
    assert coef < 0.26
    _check_update(r, coef=coef)


# ------------------------------------------------- loss aggregation, micro-batches, PPO epochs, minibatches

@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("agg,micro", [("token-mean", 7), ("seq-mean-token-mean", 0), ("seq-mean-token-mean", 7),
                                       ("seq-sum", 0), ("seq-sum", 7)])
def test_aggregation_modes_and_micro_batches_match_the_reference(agg, micro, packing):
    """Each aggregation mode against its formula (``_agg_weights``), unsplit and in micro-batches of 7
    tokens (A's 6 positions and B's 7 cannot share one: two micro-batches, gradients accumulated), in
    both micro-batch layouts."""
    r = _run_case(max_grad_norm_factor=1e3, temperature=1.0, agg=agg, micro=micro, norm=5 if agg == "seq-sum" else None,
                  packing=packing)
    m = r["metrics"]
    assert m["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(r["total_norm"], rel=1e-5)
    assert m["entropy"] == pytest.approx(r["entropy"], rel=1e-5)
    assert m["micro_batches"] == (2 if micro else 1) and m["updates"] == 1 and m["tokens"] == 7
    # the on-policy loss is -sum_seq weight * sum_tokens w A: a number independent of the model
    wa, wb = _agg_weights(agg, 5)
    w = [min(math.exp(-d), 2.0) for d in DELTA_A + DELTA_B]
    want = -(wa * ADV_A * sum(w[:4]) + wb * ADV_B * sum(w[4:]))
    assert r["loss"] == pytest.approx(want, rel=1e-5)
    _check_update(r, coef=1.0)


def test_micro_batches_group_by_padded_tokens():
    mb = _train().micro_batches
    lengths = [5, 9, 3, 9, 2]
    # longest first; a micro-batch holds n sequences while n x its longest <= budget
    assert mb(lengths, 20) == [[1, 3], [0, 2, 4]]
    assert mb(lengths, 4) == [[1], [3], [0], [2], [4]]  # longer than the budget: alone, never split
    assert mb(lengths, 0) == [[0, 1, 2, 3, 4]]
    assert mb([], 8) == []


class _Recording(torch.optim.SGD):
    """SGD that keeps, at every step, the parameters it is about to change and their gradients."""

    def __init__(self, named, lr):
        self.names = [n for n, p in named if p.requires_grad]
        params = [p for n, p in named if p.requires_grad]
        super().__init__(params, lr=lr)
        self.params_before, self.grads = [], []

    def step(self, closure=None):
        ps = self.param_groups[0]["params"]
        self.params_before.append({n: p.detach().clone() for n, p in zip(self.names, ps)})
        self.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in zip(self.names, ps)})
        return super().step(closure)


def test_second_epoch_gradient_is_zero_for_clipped_tokens():
    """Two PPO epochs on one minibatch. The first update is on-policy (logp_old from the pass before
    it: ratio 1, nothing clipped). The second sees ratio = p_theta1 / p_theta0, computed here from two
    unpacked forwards: a token whose ratio left the clip range on the side its advantage pushes
    (A > 0 and ratio > 1 + eps_high, or A < 0 and ratio < 1 - eps_low) contributes no gradient, every
    other token -w A ratio d logp / #tokens. The step's gradient, clip fraction, approx-KL and the
    ratio's range must be these."""
    eps_low, eps_high, cap, lr = 0.2, 0.28, 2.0, 5e-5
    m = _model()
    ra, rb = _routing(len(PROMPT_A) + len(OUT_A) - 1, 1), _routing(len(PROMPT_B) + len(OUT_B) - 1, 2)
    m.train()

    def logps(model):
        return [_generated(_forced_alone(model, p, o, r), p, o, 1.0)[0] for p, o, r in
                ((PROMPT_A, OUT_A, ra), (PROMPT_B, OUT_B, rb))]

    with torch.no_grad():
        old = logps(m)  # theta0
    rollouts = [old[0] + torch.tensor(DELTA_A), old[1] + torch.tensor(DELTA_B)]
    seqs = [_train().RLSequence(PROMPT_A, OUT_A, rollouts[0].tolist(), ADV_A, ra),
            _train().RLSequence(PROMPT_B, OUT_B, rollouts[1].tolist(), ADV_B, rb)]
    opt = _Recording(list(m.named_parameters()), lr)
    metrics = _step(m, opt, seqs, temperature=1.0, ppo_epochs=2, clip_eps_low=eps_low, clip_eps_high=eps_high,
                    tis_cap=cap, max_grad_norm=1e9)
    assert metrics["updates"] == 2 and len(opt.grads) == 2
    first, second = metrics["per_update"]
    assert first["clip_fraction"] == 0.0 and first["approx_kl"] < 1e-9
    assert abs(first["ratio_min"] - 1) < 1e-5 and abs(first["ratio_max"] - 1) < 1e-5

    # the reference at theta1 (the parameters the second step started from)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n in opt.params_before[1]:
                p.copy_(opt.params_before[1][n])
    new = logps(m)
    ratios = [torch.exp(lp - o) for lp, o in zip(new, old)]
    advs = [ADV_A, ADV_B]
    clipped = [(r > 1 + eps_high) if a > 0 else (r < 1 - eps_low) for r, a in zip(ratios, advs)]
    r_all = torch.cat([r.detach() for r in ratios])
    n_clipped = int(sum(c.sum() for c in clipped))
    assert 0 < n_clipped < 7, "the case must clip some tokens and not others"
    bounds = torch.tensor([1 - eps_low, 1 + eps_high])
    assert float((r_all.unsqueeze(1) - bounds).abs().min()) > 1e-3, "no ratio on a clip boundary (rounding)"
    ws = [torch.clamp(torch.exp(-torch.tensor(d)), max=cap) for d in (DELTA_A, DELTA_B)]
    pg = -sum((w * a * r * ~c).sum() for w, a, r, c in zip(ws, advs, ratios, clipped)) / 7
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    params = [p for p in m.parameters() if p.requires_grad]
    want = dict(zip(names, torch.autograd.grad(pg, params, allow_unused=True)))
    for n in names:
        got, g = opt.grads[1][n], want[n]
        if g is None or float(g.abs().max()) == 0:
            assert got is None or float(got.abs().max()) < 1e-6 * max(float(x.abs().max()) for x in want.values()
                                                                       if x is not None), n
            continue
        torch.testing.assert_close(got, g, rtol=1e-3, atol=1e-4 * float(g.abs().max()), msg=lambda s: f"{n}: {s}")
    # the clipped tokens' terms are constants: the loss by hand, and the statistics
    loss = -sum((w * torch.where(c, r.detach().clamp(1 - eps_low, 1 + eps_high), r.detach()) * a).sum()
                for w, a, r, c in zip(ws, advs, ratios, clipped)) / 7
    assert second["loss"] == pytest.approx(float(loss), rel=1e-4)
    assert second["clip_fraction"] == pytest.approx(n_clipped / 7)
    assert second["approx_kl"] == pytest.approx(float((r_all - 1 - r_all.log()).mean()), rel=1e-3)
    assert second["ratio_min"] == pytest.approx(float(r_all.min()), rel=1e-4)
    assert second["ratio_max"] == pytest.approx(float(r_all.max()), rel=1e-4)
    assert second["ratio_std"] == pytest.approx(float(r_all.std(unbiased=False)), rel=1e-3)
    # step metrics: means over updates, first / last, the outer range; the batch's TIS statistics
    assert metrics["clip_fraction"] == pytest.approx(n_clipped / 14)
    assert metrics["clip_fraction_last"] == second["clip_fraction"] and metrics["clip_fraction_first"] == 0.0
    assert metrics["ratio_max"] == second["ratio_max"]
    assert metrics["tis_truncated_fraction"] == pytest.approx(2 / 7)


def _batch(n=6, seed=0):
    """``n`` sequences of different prompt and completion lengths, seeded tokens, advantages, rollout
    logprobs and routing."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        p = [256] + torch.randint(0, 256, (1 + i % 3,), generator=g).tolist()
        o = torch.randint(0, 256, (2 + (i * 2) % 5,), generator=g).tolist()
        roll = (-5.0 + torch.rand(len(o), generator=g)).tolist()
        adv = float(torch.randn(1, generator=g))
        seqs.append(_train().RLSequence(p, o, roll, adv, _routing(len(p) + len(o) - 1, 10 + i)))
    return seqs


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-sum"])
def test_minibatch_updates_do_not_depend_on_the_micro_batch_split(agg):
    """2 PPO epochs x 2 minibatches (4 optimizer steps, logp_old once before the first): the same
    shuffle (seeded), once with whole minibatches and once in micro-batches of at most 12 padded
    tokens. Parameters and every update's statistics agree up to float rounding."""
    seqs = _batch()
    runs = []
    for budget in (0, 12):
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=2e-5)
        torch.manual_seed(123)
        met = _step(m, opt, seqs, temperature=1.0, ppo_epochs=2, minibatches=2, micro_batch_tokens=budget,
                    loss_aggregation=agg, max_grad_norm=1e9, seq_sum_norm=6)
        runs.append((m, met))
    (m0, a), (m1, b) = runs
    assert a["updates"] == b["updates"] == 4
    assert a["micro_batches"] == 4 and b["micro_batches"] >= 8  # every minibatch split
    # each pass sees every sequence once, split 3 + 3
    assert [u["sequences"] for u in a["per_update"]] == [3, 3, 3, 3]
    tokens = sum(len(s.output_ids) for s in seqs)
    assert sum(u["tokens"] for u in a["per_update"][:2]) == tokens == a["tokens"]
    assert a["approx_kl_last"] > 1e-4 and a["ratio_std_last"] > 1e-3  # the later updates are off-policy
    for ua, ub in zip(a["per_update"], b["per_update"]):
        # Rounding differences (summation order) grow over the four steps of this peaky model (gradient
        # norms 10-300): seen up to 1e-4 relative by the last update. A normaliser taken per micro-batch
        # instead of per minibatch, or a lost micro-batch, changes these by O(1).
        for k in ("loss", "grad_norm", "approx_kl", "ratio_mean", "ratio_std", "ratio_min", "ratio_max"):
            assert ub[k] == pytest.approx(ua[k], rel=1e-3, abs=1e-5), k
        assert ub["clip_fraction"] == pytest.approx(ua["clip_fraction"], rel=1e-6)  # same tokens clipped
    assert max(u["clip_fraction"] for u in a["per_update"]) > 0  # the split is checked where clipping acts
    start = dict(_model().named_parameters())
    for (n, p), q in zip(m0.named_parameters(), m1.parameters()):
        step = float((p - start[n]).abs().max())
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4 * step + 1e-6, msg=lambda s: f"{n}: {s}")


def _scored_table(groups):
    """A scored table (the columns ``train_on_table`` reads) from ``groups``: one list of rewards per
    prompt; advantages group-normalised as the score stage computes them."""
    import pyarrow as pa

    from k3core.rl.grpo import group_advantages

    rows = {k: [] for k in ("prompt_index", "sample_index", "prompt_ids", "output_ids", "logprobs", "routing",
                            "reward", "advantage")}
    seqs = _batch(sum(len(g) for g in groups), seed=3)
    i = 0
    for gi, rewards in enumerate(groups):
        adv = group_advantages(torch.tensor(rewards), len(rewards)).tolist()
        for j, (r, a) in enumerate(zip(rewards, adv)):
            s = seqs[i]
            i += 1
            rows["prompt_index"].append(gi)
            rows["sample_index"].append(j)
            rows["prompt_ids"].append(s.prompt_ids)
            rows["output_ids"].append(s.output_ids)
            rows["logprobs"].append(s.rollout_logprobs)
            rows["routing"].append(s.routing.reshape(-1).tolist())
            rows["reward"].append(r)
            rows["advantage"].append(a)
    return pa.table(rows)


def test_dynamic_sampling_drops_uniform_groups():
    """Groups whose rewards are all equal are dropped and counted; the update equals a step on the
    other groups alone, with their zero-advantage members kept (they count in the loss's normaliser)."""
    from k3core.settings import GRPOSettings

    tr = _train()
    table = _scored_table([[0.5, 0.5, 0.5], [0.0, 0.5, 1.0], [1.0, 1.0, 1.0]])
    cfg = GRPOSettings(routing_replay=True, max_grad_norm=1e9)
    m, ref = _model(), _model()
    met = tr.train_on_table(m, torch.optim.SGD(m.parameters(), lr=1e-4), table, cfg, PAD)
    assert (met["groups_sampled"], met["groups_dropped"], met["groups_trained"], met["sequences"], met["skipped"]) == \
        (3, 2, 1, 3, 0.0)
    kept = tr.table_to_sequences(table.slice(3, 3), len(TINY.moe_layers), K)
    assert [s.advantage for s in kept][1] == 0.0  # the middle reward: zero advantage, still trained on
    want = tr.grpo_train_step(ref, torch.optim.SGD(ref.parameters(), lr=1e-4), kept, cfg, PAD)
    assert met["tokens"] == want["tokens"] and met["loss"] == want["loss"]
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    # a refilled batch keeps its size: the first max_groups informative groups by prompt index
    table = _scored_table([[0.0, 1.0], [0.5, 0.5], [1.0, 0.0], [0.2, 0.3]])
    m, ref = _model(), _model()
    met = tr.train_on_table(m, torch.optim.SGD(m.parameters(), lr=1e-4), table, cfg, PAD, max_groups=2)
    assert (met["groups_sampled"], met["groups_dropped"], met["groups_trained"], met["groups_unused"]) == (4, 1, 2, 1)
    first_two = tr.table_to_sequences(table.slice(0, 2), len(TINY.moe_layers), K) + \
        tr.table_to_sequences(table.slice(4, 2), len(TINY.moe_layers), K)
    tr.grpo_train_step(ref, torch.optim.SGD(ref.parameters(), lr=1e-4), first_two, cfg, PAD)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    # every group uniform: nothing to train on, nothing moves
    m2 = _model()
    met = tr.train_on_table(m2, torch.optim.SGD(m2.parameters(), lr=1e-4), _scored_table([[0.0, 0.0], [1.0, 1.0]]),
                            cfg, PAD)
    assert (met["skipped"], met["groups_sampled"], met["groups_dropped"], met["sequences"]) == (1.0, 2, 2, 0)
    for p, q in zip(m2.parameters(), _model().parameters()):
        assert torch.equal(p, q)


def test_lr_warmup_ramps_then_holds_and_continues_after_a_reload():
    """``ramped_step`` equals Adam stepped by hand at lr * min(1, (k + 1) / N) on step k, keeps the
    group's own rate between steps, and a reloaded optimizer state continues the ramp where it
    stopped (Adam keeps its step count in its state)."""
    from k3core.rl.train import ramped_step, warmup_factor

    torch.manual_seed(0)
    grads = [torch.randn(5) for _ in range(7)]
    a, b = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(5))
    ramped, by_hand = torch.optim.Adam([a], lr=0.1), torch.optim.Adam([b], lr=0.1)
    for k, g in enumerate(grads):
        a.grad, b.grad = g.clone(), g.clone()
        ramped_step(ramped, 4)
        by_hand.param_groups[0]["lr"] = 0.1 * min(1.0, (k + 1) / 4)
        by_hand.step()
        assert torch.equal(a, b), k
        assert ramped.param_groups[0]["lr"] == 0.1
    half = torch.optim.Adam([torch.nn.Parameter(torch.zeros(5))], lr=0.1)
    for g in grads[:2]:
        half.param_groups[0]["params"][0].grad = g.clone()
        ramped_step(half, 4)
    again = torch.optim.Adam([torch.nn.Parameter(torch.zeros(5))], lr=0.1)
    again.load_state_dict(half.state_dict())
    assert warmup_factor(again, 4) == pytest.approx(3 / 4) and warmup_factor(again, 0) == 1.0


# ------------------------------------------------------------------ rollout corrections (IcePop, MIS, ...)
# Token ratios rho = exp(-delta): A e, 0.670, 1.221, 1 (product e^0.8 = 2.226, geometric mean e^0.2);
# B 0.497, 3.669, 0.905 (product e^0.5 = 1.649, geometric mean e^(1/6) = 1.181).
RHO_A, RHO_B = [math.exp(-d) for d in DELTA_A], [math.exp(-d) for d in DELTA_B]


def _corrected(name):
    """(settings, per-token weight of A and of B with rejected tokens at 0, aggregation weights of A and
    B), each written from the correction's definition on the ratios above."""
    a_prod, b_prod = math.exp(0.8), math.exp(0.5)
    cases = {
        # IcePop: 1[0.5 <= rho <= 2] rho (a cap at the band's top never engages); kept A 0.670, 1.221,
        # 1 and B 0.905: 4 tokens
        "icepop": ({"rollout_rs": "token", "rs_low": 0.5, "rs_high": 2.0, "tis_cap": 2.0},
                   [[r if 0.5 <= r <= 2 else 0.0 for r in RHO_A], [r if 0.5 <= r <= 2 else 0.0 for r in RHO_B]],
                   (1 / 4, 1 / 4)),
        # sequence TIS: min(prod rho, 2) on every token of the sequence, nothing rejected
        "sequence-tis": ({"rollout_is": "sequence", "tis_cap": 2.0},
                         [[min(a_prod, 2.0)] * 4, [min(b_prod, 2.0)] * 3], (1 / 7, 1 / 7)),
        # MIS: the sequence ratio where it is <= 2, the sequence dropped otherwise: A (2.226) goes, B stays
        "mis": ({"rollout_is": "sequence", "rollout_rs": "sequence", "rs_low": 0.0, "rs_high": 2.0, "tis_cap": 2.0},
                [[0.0] * 4, [b_prod] * 3], (1 / 3, 1 / 3)),
        # geometric-mean masking with a band [1.2, 1.3] (A's 1.221 in, B's 1.181 out) beside token TIS;
        # every sequence counts the same over the kept: one sequence of 4 tokens
        "geometric": ({"rollout_rs": "geometric", "rs_low": 1.2, "rs_high": 1.3, "tis_cap": 2.0,
                       "loss_aggregation": "seq-mean-token-mean"},
                      [[min(r, 2.0) for r in RHO_A], [0.0] * 3], (1 / 4, 1 / 4)),
    }
    return cases[name]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("name", ["icepop", "sequence-tis", "mis", "geometric"])
def test_rollout_corrections_match_their_definitions(name, packing):
    """Each correction's on-policy update against its formula: the loss is
    -sum_seq weight_seq * sum_tokens w_t A (a number independent of the model), rejected tokens count in
    no denominator, and every parameter moves by the gradient of that loss."""
    tr = _train()
    settings, ws, (ka, kb) = _corrected(name)
    m = _model()
    ra, rb = _routing(len(PROMPT_A) + len(OUT_A) - 1, 1), _routing(len(PROMPT_B) + len(OUT_B) - 1, 2)
    m.train()
    lp_a = _generated(_forced_alone(m, PROMPT_A, OUT_A, ra), PROMPT_A, OUT_A, 1.0)[0]
    lp_b = _generated(_forced_alone(m, PROMPT_B, OUT_B, rb), PROMPT_B, OUT_B, 1.0)[0]
    pg = -(ka * (torch.tensor(ws[0]) * ADV_A * lp_a).sum() + kb * (torch.tensor(ws[1]) * ADV_B * lp_b).sum())
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(pg, [p for p in m.parameters() if p.requires_grad], allow_unused=True)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    rollouts = [lp_a.detach() + torch.tensor(DELTA_A), lp_b.detach() + torch.tensor(DELTA_B)]
    seqs = [tr.RLSequence(PROMPT_A, OUT_A, rollouts[0].tolist(), ADV_A, ra),
            tr.RLSequence(PROMPT_B, OUT_B, rollouts[1].tolist(), ADV_B, rb)]
    metrics = _step(m, torch.optim.SGD(m.parameters(), lr=1.0), seqs, temperature=1.0, max_grad_norm=1e9,
                    packing=packing, **settings)
    want = -(ka * ADV_A * sum(ws[0]) + kb * ADV_B * sum(ws[1]))
    assert metrics["loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    kept = sum(w != 0.0 for w in ws[0] + ws[1])
    assert metrics["tokens"] == kept and metrics["rs_masked_fraction"] == pytest.approx(1 - kept / 7)
    # the mismatch is still measured over every token, the rejected ones too: k1 = mean(delta)
    assert metrics["kl_rollout_trainer_k1"] == pytest.approx(sum(DELTA_A + DELTA_B) / 7, rel=1e-4, abs=1e-6)
    assert metrics["ratio_rollout_p50"] == pytest.approx(sorted(RHO_A + RHO_B)[3], rel=1e-4)
    r = dict(grads={**dict(zip(names, grads)), **{n: None for n, p in m.named_parameters() if not p.requires_grad}},
             before=before, after={n: p.detach().clone() for n, p in m.named_parameters()}, lr=1.0)
    _check_update(r, coef=1.0)
