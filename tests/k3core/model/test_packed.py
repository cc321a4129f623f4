"""Packed (varlen) sequences through the model against each sequence run alone, unpadded.

The reference of every test here is the plain path the model already had: one sequence per forward,
no mask, no padding. A packed row must give each of its sequences exactly those logits (fp32,
summation-order tolerance), so nothing may cross a boundary: the KDA short convolution, the KDA
state, MLA attention. Each boundary test also runs the leaky computation (the same row as one long
sequence) and checks that it differs where the boundary matters, so a packed path that leaked would
fail it.
"""

import pytest
import torch
import torch.nn.functional as F

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.model.kda import KimiDeltaAttention, ShortConv
from k3core.model.mla import GatedMLA
from k3core.model.varlen import VarlenLayout

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = K3Config.preset("tiny")
# lengths: one token, shorter than the conv kernel (4), longer than a KDA chunk (64), and in between
LENGTHS = [9, 1, 70, 3, 25]


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _model(seed=0) -> K3ForCausalLM:
    torch.manual_seed(seed)
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):  # non-uniform AttnRes mixing, so the mix matters
                p.normal_(0, 0.5)
    return m.float().train()


def _close(got, want, rel=2e-5):
    """fp32: packed and alone differ in summation order only (conv as a sum over lags, other KDA
    chunk sizes); a leak moves values by O(1) of their scale."""
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * float(want.detach().abs().max()))


def _seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def test_tiny_preset_has_every_layer_kind():
    """The model tests below mean something only if the preset mixes KDA, MLA, MoE and AttnRes blocks."""
    kinds = {TINY.layer_type(i) for i in range(TINY.num_hidden_layers)}
    assert kinds == {"kda", "mla"} and TINY.moe_layers
    assert TINY.num_hidden_layers > TINY.attn_res_block_size  # more than one AttnRes block


def test_packed_logits_equal_each_sequence_alone():
    m = _model()
    seqs = _seqs(LENGTHS)
    packed = m(torch.cat(seqs).unsqueeze(0), cu_seqlens=_cu(LENGTHS), return_routing=True)
    alone = [m(s.unsqueeze(0), return_routing=True) for s in seqs]
    _close(packed.logits, torch.cat([a.logits for a in alone], 1))
    # the router is per token: the packed row picks the experts each sequence picks alone
    assert torch.equal(packed.routing, torch.cat([a.routing for a in alone], 1))
    # the leaky computation (the row as one sequence) differs on every sequence after the first
    leaky = m(torch.cat(seqs).unsqueeze(0)).logits
    start = LENGTHS[0]
    for n in LENGTHS[1:]:
        assert (leaky[0, start:start + n] - packed.logits[0, start:start + n]).abs().max() > 1e-3
        start += n


def test_packed_log_probabilities_and_gradients_equal_the_sum_over_sequences():
    """The loss of a packed row and its gradient equal those of the sequences run one at a time."""
    m = _model()
    seqs = _seqs(LENGTHS, seed=2)
    params = [p for p in m.parameters() if p.requires_grad]
    ids = torch.cat(seqs).unsqueeze(0)
    tgt = torch.cat([s.roll(-1) for s in seqs]).unsqueeze(0)
    lp = m(ids, cu_seqlens=_cu(LENGTHS), targets=tgt, return_logprobs=True).logprobs
    g_packed = torch.autograd.grad(lp.sum(), params, allow_unused=True)
    lp_alone = [m(s.unsqueeze(0), targets=s.roll(-1).unsqueeze(0), return_logprobs=True).logprobs for s in seqs]
    g_alone = torch.autograd.grad(sum(x.sum() for x in lp_alone), params, allow_unused=True)
    _close(lp, torch.cat(lp_alone, 1))
    for a, b in zip(g_packed, g_alone):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()) + 1e-9)


def test_short_conv_does_not_leak_across_boundaries():
    """``forward_packed`` against ``F.conv1d`` (the decode path's ``forward``) per sequence; the
    first sequence is large, so any leak into the next one's first ``kernel - 1`` outputs shows."""
    torch.manual_seed(0)
    conv = ShortConv(8, 4)
    lengths = [6, 2, 5]
    xs = [torch.randn(n, 8) * (100.0 if i == 0 else 1.0) for i, n in enumerate(lengths)]
    layout = VarlenLayout.from_cu_seqlens(_cu(lengths), sum(lengths))
    got = conv.forward_packed(torch.cat(xs).unsqueeze(0), layout)
    want = torch.cat([conv(x.unsqueeze(0), None)[0] for x in xs], 1)
    _close(got, want, rel=1e-6)
    leaky = conv(torch.cat(xs).unsqueeze(0), None)[0]
    assert (leaky[0, 6:8] - got[0, 6:8]).abs().amax(-1).min() > 1e-2  # the second sequence sits within the kernel
    torch.testing.assert_close(leaky[0, :6], got[0, :6])  # the first sequence sees nothing before it


def test_kda_layer_state_does_not_leak_across_boundaries():
    """A KDA layer on a packed row against each sequence alone. The leaky run (one long sequence)
    differs on the second sequence's positions past the conv kernel too: there only the recurrent
    state carries the first sequence, so this checks the state, not only the convolution."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(TINY, 0).float()
    lengths = [30, 20]
    xs = [torch.randn(n, TINY.hidden_size) for n in lengths]
    layout = VarlenLayout.from_cu_seqlens(_cu(lengths), sum(lengths))
    got = layer(torch.cat(xs).unsqueeze(0), varlen=layout)
    want = torch.cat([layer(x.unsqueeze(0)) for x in xs], 1)
    _close(got, want)
    leaky = layer(torch.cat(xs).unsqueeze(0))
    k = TINY.kda_short_conv_kernel_size
    assert (leaky[0, 30 + k:] - got[0, 30 + k:]).abs().amax(-1).min() > 1e-4


def test_mla_packed_equals_the_block_diagonal_causal_mask():
    """Packed MLA against SDPA over the whole row with a block-diagonal causal mask written out here
    from the lengths, and against each sequence alone."""
    torch.manual_seed(0)
    layer = GatedMLA(TINY, 3).float()
    lengths = [5, 1, 12, 7]
    T = sum(lengths)
    x = torch.randn(1, T, TINY.hidden_size)
    layout = VarlenLayout.from_cu_seqlens(_cu(lengths), T)
    got = layer(x, varlen=layout)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    mask = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(layout.block_causal_mask(), mask)
    q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(1, T, layer.num_heads, -1)
    qh, kh, vh = (t.transpose(1, 2) for t in layer._expand(q, layer._latent(x)))
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=layer.scale).transpose(1, 2)
    want = layer.o_proj(o.reshape(1, T, -1) * torch.sigmoid(layer.g_proj(x)))
    _close(got, want)
    starts = layout.cu_seqlens.tolist()
    alone = torch.cat([layer(x[:, a:b]) for a, b in zip(starts[:-1], starts[1:])], 1)
    _close(got, alone)
    assert (layer(x) - got)[0, 5:].abs().amax(-1).min() > 1e-4  # plain causal over the row sees the others


def test_routing_replay_packed():
    """Forced routing on a packed row (each sequence's expert ids back to back) gives each sequence
    the logits it has alone with the same experts forced, reports exactly the forced ids, and other
    forced experts change the logits."""
    m = _model()
    seqs = _seqs(LENGTHS, seed=3)
    n_moe, k, E = len(TINY.moe_layers), TINY.num_experts_per_token, TINY.num_experts
    g = torch.Generator().manual_seed(4)
    routes = [torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n_moe)]) for _ in range(n)])
              for n in LENGTHS]
    forced = torch.cat(routes).unsqueeze(0)
    packed = m(torch.cat(seqs).unsqueeze(0), cu_seqlens=_cu(LENGTHS), forced_routing=forced, return_routing=True)
    assert torch.equal(packed.routing, forced)
    alone = [m(s.unsqueeze(0), forced_routing=r.unsqueeze(0)).logits for s, r in zip(seqs, routes)]
    _close(packed.logits, torch.cat(alone, 1))
    free = m(torch.cat(seqs).unsqueeze(0), cu_seqlens=_cu(LENGTHS)).logits
    assert (free - packed.logits).abs().max() > 1e-3


def test_packed_inputs_are_checked():
    m = _model()
    ids = torch.randint(0, 256, (1, 10))
    with pytest.raises(ValueError, match="rise strictly from 0"):
        m(ids, cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="rise strictly from 0"):
        m(ids, cu_seqlens=torch.tensor([0, 4, 4, 10], dtype=torch.int32))  # an empty sequence
    with pytest.raises(ValueError, match=r"input_ids \[1, T\]"):
        m(torch.randint(0, 256, (2, 5)), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="no attention_mask"):
        m(ids, torch.ones(1, 10, dtype=torch.bool), cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))
