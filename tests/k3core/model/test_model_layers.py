"""Layer-level checks of the K3 model against independent transcriptions of the reference."""

import math

import torch

from k3core.config import K3Config
from k3core.model.attnres import attn_res_mix
from k3core.model.kda import KimiDeltaAttention
from k3core.model.mla import GatedMLA
from k3core.model.moe import LatentMoE, dense_reference_moe, select_experts
from k3core.model.norm import rms_norm

TINY = K3Config.preset("tiny")


def test_rms_norm_formula():
    x = torch.randn(3, 5, dtype=torch.float64)
    w = torch.randn(5, dtype=torch.float64)
    expect = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), expect)


def test_attn_res_mix_matches_direct_transcription():
    torch.manual_seed(0)
    D, eps = 6, 1e-5
    blocks = [torch.randn(2, 3, D, dtype=torch.float64) for _ in range(3)]
    p = torch.randn(2, 3, D, dtype=torch.float64)
    w, gamma = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    out = attn_res_mix(p, blocks, w * gamma, eps)
    # per token, by the letter of the reference: s = sum_i (v_i / rms(v)) * w_i * gamma_i
    cands = blocks + [p]
    expect = torch.zeros_like(p)
    for b in range(2):
        for t in range(3):
            scores = []
            for v in cands:
                vv = v[b, t]
                rms = math.sqrt(float((vv * vv).mean()) + eps)
                scores.append(sum(float(vv[i]) / rms * float(w[i]) * float(gamma[i]) for i in range(D)))
            m = max(scores)
            e = [math.exp(s - m) for s in scores]
            for c, v in zip(e, cands):
                expect[b, t] += c / sum(e) * v[b, t]
    torch.testing.assert_close(out, expect)


def test_attn_res_zero_w_is_uniform_average():
    blocks = [torch.randn(1, 2, 4) for _ in range(2)]
    p = torch.randn(1, 2, 4)
    out = attn_res_mix(p, blocks, torch.zeros(4), 1e-5)
    torch.testing.assert_close(out, (blocks[0] + blocks[1] + p) / 3)


def _moe(seed=0, dtype=torch.float64, **over):
    torch.manual_seed(seed)
    cfg = TINY.replace(**over)
    moe = LatentMoE(cfg).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    return cfg, moe


def test_moe_sparse_equals_dense_reference():
    cfg, moe = _moe()
    x = torch.randn(2, 7, cfg.hidden_size, dtype=torch.float64)
    y, ids = moe(x)
    torch.testing.assert_close(y, dense_reference_moe(moe, x))
    assert ids.shape == (2, 7, cfg.num_experts_per_token)


def test_moe_bias_shifts_selection_not_weights():
    cfg, moe = _moe(seed=1)
    x = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    bias = torch.zeros(cfg.num_experts)
    bias[3] = 100.0  # expert 3 always selected, but its weight is its unbiased score
    moe.gate.e_score_correction_bias.copy_(bias)
    ids, w = moe.route(x)
    assert (ids == 3).any(-1).all()
    scores = torch.sigmoid(x.float() @ moe.gate.weight.float().t()).double()
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(w.double(), chosen / chosen.sum(-1, keepdim=True) * cfg.routed_scaling_factor)
    torch.testing.assert_close(w.sum(-1).double(), torch.full((5,), cfg.routed_scaling_factor, dtype=torch.float64))
    y, _ = moe(x)
    torch.testing.assert_close(y, dense_reference_moe(moe, x))


def test_moe_forced_routing_replays():
    cfg, moe = _moe(seed=2)
    x = torch.randn(4, cfg.hidden_size, dtype=torch.float64)
    y, ids = moe(x)
    forced = torch.stack([torch.randperm(cfg.num_experts)[: cfg.num_experts_per_token] for _ in range(4)])
    y2, ids2 = moe(x, forced_ids=forced)
    assert torch.equal(ids2, forced)
    torch.testing.assert_close(y2, dense_reference_moe(moe, x, forced))
    y3, _ = moe(x, forced_ids=ids)
    torch.testing.assert_close(y3, y)


def test_grouped_topk_respects_groups():
    biased = torch.tensor([[0.9, 0.8, 0.1, 0.0, 0.7, 0.75, 0.2, 0.1]])
    # groups of 2: sums of top-2 = [1.7, 0.1, 1.45, 0.3]; keep 2 groups -> experts {0,1,4,5}
    ids = select_experts(biased, 3, num_groups=4, topk_groups=2)
    assert set(ids[0].tolist()) == {0, 1, 5}
    assert set(select_experts(biased, 3).tolist()[0]) == {0, 1, 5}


def test_layers_gradcheck_fp64():
    torch.manual_seed(0)
    cfg = TINY.replace(hidden_size=16, kda_head_dim=8, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                       qk_rope_head_dim=4, v_head_dim=4, moe_intermediate_size=8, routed_expert_hidden_size=8)
    x = torch.randn(1, 4, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    kda = KimiDeltaAttention(cfg, 0).double()
    mla = GatedMLA(cfg, 3).double()
    _, moe = _moe(seed=3, hidden_size=16, moe_intermediate_size=8, routed_expert_hidden_size=8)
    for layer in (kda, mla):
        for p in layer.parameters():
            p.requires_grad_(False)
        assert torch.autograd.gradcheck(lambda t: layer(t), (x,), eps=1e-6, atol=1e-5, fast_mode=True)
    for p in moe.parameters():
        p.requires_grad_(False)
    # routing is piecewise constant: gradcheck holds where no near-tie flips the selection
    assert torch.autograd.gradcheck(lambda t: moe(t)[0], (x,), eps=1e-6, atol=1e-5, fast_mode=True)
    blocks = [torch.randn(1, 5, 8, dtype=torch.float64) for _ in range(2)]
    wg = torch.randn(8, dtype=torch.float64, requires_grad=True)
    p = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: attn_res_mix(a, blocks, b, 1e-5), (p, wg))


def test_kda_layer_pads_are_neutral():
    """Left pads (masked) leave the layer's outputs at real positions unchanged."""
    torch.manual_seed(0)
    layer = KimiDeltaAttention(TINY, 0).double()
    x = torch.randn(1, 6, TINY.hidden_size, dtype=torch.float64)
    pad = torch.randn(1, 3, TINY.hidden_size, dtype=torch.float64)
    mask = torch.tensor([[False] * 3 + [True] * 6])
    y_ref = layer(x)
    y_pad = layer(torch.cat([pad, x], 1), mask)[:, 3:]
    torch.testing.assert_close(y_pad, y_ref)


def test_mla_layer_pads_are_neutral():
    torch.manual_seed(0)
    layer = GatedMLA(TINY, 3).double()
    x = torch.randn(1, 6, TINY.hidden_size, dtype=torch.float64)
    pad = torch.randn(1, 2, TINY.hidden_size, dtype=torch.float64)
    mask = torch.tensor([[False] * 2 + [True] * 6])
    torch.testing.assert_close(layer(torch.cat([pad, x], 1), mask)[:, 2:], layer(x))


def test_mla_is_softmax_attention_without_rotary():
    """Direct transcription of the reference equations (no SDPA, no absorption)."""
    torch.manual_seed(0)
    c = TINY
    layer = GatedMLA(c, 3).double()
    B, T, H = 1, 4, c.num_attention_heads
    x = torch.randn(B, T, c.hidden_size, dtype=torch.float64)
    q = layer.q_b_proj(rms_norm(layer.q_a_proj(x), layer.q_a_layernorm.weight, c.rms_norm_eps)).view(B, T, H, -1)
    kva = layer.kv_a_proj_with_mqa(x)
    lat, tail = kva[..., : c.kv_lora_rank], kva[..., c.kv_lora_rank:]
    kvb = layer.kv_b_proj(rms_norm(lat, layer.kv_a_layernorm.weight, c.rms_norm_eps)).view(B, T, H, -1)
    kn, v = kvb[..., : c.qk_nope_head_dim], kvb[..., c.qk_nope_head_dim:]
    k = torch.cat([kn, tail.unsqueeze(2).expand(B, T, H, c.qk_rope_head_dim)], -1)
    s = torch.einsum("bthd,bshd->bhts", q, k) * (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, -1)
    expect = layer.o_proj(o * torch.sigmoid(layer.g_proj(x)))
    torch.testing.assert_close(layer(x), expect)
