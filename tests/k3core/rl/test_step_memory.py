"""The train step's full-vocabulary tensors: what is alive during backward, and the entropy statistic.

The step reads its entropy statistic from the log-softmax that autograd saves anyway, before
backward, and drops it, so no ``[T, V]`` fp32 tensor of its own is alive while backward runs (at
medium, T = 8192: 5 GiB each). The statistic is checked against an independent float64 computation.
"""

import weakref

import pytest
import torch

import k3core.rl.grpo as grpo
from k3core.config import K3Config
from k3core.rl import train as tr
from k3core.settings import GRPOSettings
from tests.k3core.rl.test_train_step import _batch, _model

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = K3Config.preset("tiny")


def _naive_entropy(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over masked positions of -sum p log p, in float64."""
    lp = torch.log_softmax(logits.double(), -1)
    ent = -(lp.exp() * lp).sum(-1)
    return float(ent[mask].mean())


def test_mean_entropy_equals_float64_and_does_not_depend_on_the_chunks(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g) * 4
    mask = torch.rand(3, 7, generator=g) > 0.3
    lp = torch.log_softmax(logits, -1)
    whole = grpo.mean_entropy(lp, mask)
    assert whole.dim() == 0 and whole.dtype == torch.float32
    assert float(whole) == pytest.approx(_naive_entropy(logits, mask), rel=1e-6)
    for rows in (1, 4, 21):  # chunks of 1 row, uneven chunks, one chunk
        monkeypatch.setattr(grpo, "ENTROPY_CHUNK_ELEMENTS", rows * 50)
        assert torch.equal(grpo.mean_entropy(lp, mask), whole), rows
    assert float(grpo.mean_entropy(lp, torch.zeros_like(mask))) == 0.0  # no masked token


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_step_entropy_equals_float64_naive(packing):
    """The step's ``entropy``: the token mean over the batch's generated positions of the tempered
    distribution's entropy, against each sequence run alone and computed in float64."""
    seqs, temperature = _batch(), 0.7
    model = _model()
    with torch.no_grad():
        ent, n = 0.0, 0
        for s in seqs:
            x = torch.tensor((s.prompt_ids + s.output_ids)[:-1]).unsqueeze(0)
            logits = model(x, forced_routing=s.routing.unsqueeze(0)).logits[0] / temperature
            gen = torch.zeros(x.shape[1], dtype=torch.bool)
            gen[len(s.prompt_ids) - 1:] = True
            ent += _naive_entropy(logits, gen) * len(s.output_ids)
            n += len(s.output_ids)
    cfg = GRPOSettings(routing_replay=True, packing=packing, micro_batch_tokens=12)
    m = tr.grpo_train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), seqs, cfg, TINY.pad_token_id,
                           temperature=temperature)
    assert m["micro_batches"] > 1
    assert m["entropy"] == pytest.approx(ent / n, rel=1e-5)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_no_full_vocabulary_tensor_of_the_step_is_alive_during_backward(monkeypatch, packing):
    """By the time backward reaches the LM head, the full-vocabulary tensor ``_forward_logp`` handed
    the step is freed (its saved copy released by the log-softmax's backward, the step's reference
    dropped before backward). Keeping the tempered logits for a statistic read after backward held
    one more ``[T, V]`` fp32 through all of it."""
    returned: list[weakref.ref] = []
    alive_at_head: list[bool] = []
    forward_logp = tr._forward_logp

    def recording(*a, **k):
        logp, full = forward_logp(*a, **k)
        assert full.shape[-1] == TINY.vocab_size and full.dtype == torch.float32
        returned.append(weakref.ref(full))
        return logp, full

    def at_head(module, args, out):  # runs inside _forward_logp: the hook looks its tensor up later
        if out.requires_grad:
            out.register_hook(lambda grad: alive_at_head.append(returned[-1]() is not None))

    monkeypatch.setattr(tr, "_forward_logp", recording)
    model = _model()
    model.lm_head.register_forward_hook(at_head)
    cfg = GRPOSettings(routing_replay=True, packing=packing, micro_batch_tokens=12)
    tr.grpo_train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), _batch(), cfg, TINY.pad_token_id)
    assert len(alive_at_head) > 1 and not any(alive_at_head), alive_at_head
