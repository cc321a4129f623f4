"""Whole-model checks: forward/backward, logprobs, routing replay, cached decode, bad input."""

import pytest
import torch
import torch.nn.functional as F

from k3core.config import K3Config
from k3core.model import K3Cache, K3ForCausalLM
from k3core.model.info import model_info

TINY = K3Config.preset("tiny")


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    # non-trivial AttnRes scores so the mixing really weighs candidates
    for n, p in m.named_parameters():
        if n.endswith("_res_proj.weight"):
            torch.nn.init.normal_(p, 0, 0.5)
    return m.to(dtype)


def test_forward_backward_and_loss():
    m = _model()
    ids = torch.randint(0, 256, (2, 9))
    out = m(ids, targets=ids.roll(-1, 1), return_logprobs=True, return_routing=True)
    assert out.logits.shape == (2, 9, TINY.vocab_size)
    assert out.routing.shape == (2, 9, len(TINY.moe_layers), TINY.num_experts_per_token)
    out.loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters()}
    # layer 0 mixes nothing before its attention (the block list is still empty), as the reference says
    unused = {"model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight"}
    assert {n for n, g in grads.items() if g is None} == unused
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)


def test_logprobs_equal_negative_cross_entropy():
    m = _model()
    ids = torch.randint(0, 256, (3, 7))
    tgt = torch.randint(0, TINY.vocab_size, (3, 7))
    out = m(ids, targets=tgt, return_logprobs=True)
    ce = F.cross_entropy(out.logits.reshape(-1, TINY.vocab_size).float(), tgt.reshape(-1), reduction="none")
    torch.testing.assert_close(out.logprobs.reshape(-1), -ce)
    mask = torch.rand(3, 7) > 0.5
    mask[0, 0] = True
    torch.testing.assert_close(m(ids, targets=tgt, loss_mask=mask).loss, ce[mask.reshape(-1)].mean())


def test_routing_replay_reproduces_forward():
    m = _model()
    ids = torch.randint(0, 256, (2, 6))
    a = m(ids, return_routing=True)
    b = m(ids, forced_routing=a.routing, return_routing=True)
    torch.testing.assert_close(a.logits, b.logits)
    assert torch.equal(a.routing, b.routing)
    other = torch.remainder(a.routing + 1, TINY.num_experts)
    c = m(ids, forced_routing=other, return_routing=True)
    assert torch.equal(c.routing, other) and not torch.allclose(c.logits, a.logits)


def test_cached_decode_equals_full_forward_every_position():
    """Left-padded batch of different lengths, prefill then one token at a time, fp32."""
    m = _model(torch.float64).eval()
    m.use_inference_caches = True
    m.refresh_inference_caches()
    lens, P, extra = [5, 3, 7], 7, 6
    seqs = [torch.randint(0, 256, (n + extra,)) for n in lens]
    ids = torch.full((3, P), TINY.pad_token_id)
    mask = torch.zeros(3, P, dtype=torch.bool)
    for b, n in enumerate(lens):
        ids[b, P - n:] = seqs[b][:n]
        mask[b, P - n:] = True
    cache = K3Cache.empty(TINY)
    with torch.no_grad():
        logits = [m(ids, mask, cache=cache).logits[:, -1]]
        for t in range(extra):
            nxt = torch.stack([s[n + t] for s, n in zip(seqs, lens)]).unsqueeze(1)
            logits.append(m(nxt, torch.ones(3, 1, dtype=torch.bool), cache=cache).logits[:, -1])
        for b, n in enumerate(lens):
            full = m(seqs[b][: n + extra].unsqueeze(0)).logits[0]
            for t in range(extra + 1):
                torch.testing.assert_close(logits[t][b], full[n - 1 + t], rtol=1e-9, atol=1e-9)


def test_kda_cache_memory_constant_in_length():
    m = _model().eval()
    sizes = []
    for T in (8, 64):
        cache = K3Cache.empty(TINY)
        with torch.no_grad():
            m(torch.randint(0, 256, (1, T)), cache=cache)
        kda = [c for c, i in zip(cache.layers, range(TINY.num_hidden_layers)) if TINY.layer_type(i) == "kda"]
        sizes.append(sum(c.nbytes() for c in kda))
    assert sizes[0] == sizes[1] > 0


def test_stale_attnres_cache_changes_logits():
    m = _model().eval()
    m.use_inference_caches = True
    m.refresh_inference_caches()
    ids = torch.randint(0, 256, (1, 5))
    before = m(ids).logits
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_res_norm.weight"):
                p.mul_(3.0)
    stale = m(ids).logits
    m.refresh_inference_caches()
    fresh = m(ids).logits
    m.use_inference_caches = False
    torch.testing.assert_close(fresh, m(ids).logits)
    assert not torch.allclose(stale, fresh)
    torch.testing.assert_close(stale, before)


def test_bad_inputs():
    m = _model()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m(torch.tensor([[1, 2, TINY.vocab_size]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m(torch.tensor([[-1, 2]]))
    with pytest.raises(NotImplementedError, match="multimodal"):
        m(torch.tensor([[1, 2]]), pixel_values=torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match="forced_routing"):
        m(torch.tensor([[1, 2]]), forced_routing=torch.zeros(1, 2, 1, 1, dtype=torch.long))


def test_forced_expert_ids_are_range_checked_once_or_by_the_caller():
    """Out-of-range forced experts fail with one message whether the model checks them (once per
    forward, for every MoE layer), the caller does (``check_inputs`` on its host tensors, then
    ``inputs_checked``), or a lone MoE layer does; ``inputs_checked`` skips only the value checks."""
    m = _model()
    n_moe, k = len(TINY.moe_layers), TINY.num_experts_per_token
    ids = torch.tensor([[1, 2, 3]])
    bad = torch.zeros(1, 3, n_moe, k, dtype=torch.long)
    bad[0, 2, n_moe - 1, 1] = TINY.num_experts
    pattern = rf"forced expert ids must lie in \[0, {TINY.num_experts}\)"
    with pytest.raises(ValueError, match=pattern):
        m(ids, forced_routing=bad)
    with pytest.raises(ValueError, match=pattern):
        m.check_inputs(ids, bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.check_inputs(torch.tensor([[1, TINY.vocab_size]]))
    with pytest.raises(ValueError, match=pattern):
        m.model.layers[TINY.moe_layers[0]].block_sparse_moe(torch.randn(3, TINY.hidden_size), bad[0, :, n_moe - 1])
    good = bad.clamp(max=TINY.num_experts - 1)
    m.check_inputs(ids, good)
    torch.testing.assert_close(m(ids, forced_routing=good, inputs_checked=True).logits,
                               m(ids, forced_routing=good).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="integer tensor"):  # dtype and shape checks stay
        m(ids.float(), inputs_checked=True)


def test_bf16_keeps_fp32_parameters():
    m = _model().cast(torch.bfloat16)
    dt = {n: p.dtype for n, p in m.named_parameters()}
    assert dt["model.layers.0.self_attn.A_log"] == torch.float32
    assert dt["model.layers.0.self_attn.q_conv1d.weight"] == torch.float32
    assert dt["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert m.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    out = m(torch.randint(0, 256, (1, 4)))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


def test_model_info_full_release_from_config():
    info = model_info(K3Config.preset("full"))
    assert 2.7e12 < info["total_params"] < 2.9e12
    assert 100e9 < info["active_params"] < 108e9
    assert 47e9 < info["routed_active_params"] < 51e9
    assert 0.44 < info["routed_active_fraction"] < 0.50
    # routed experts: 92 MoE layers x 896 experts x 3 matrices of 3584 x 3072
    assert info["routed_params"] == 92 * 896 * 3 * 3584 * 3072
    small = model_info(K3Config.preset("small"))
    assert 10e6 <= small["total_params"] <= 30e6
    medium = model_info(K3Config.preset("medium"))
    assert 1e9 <= medium["total_params"] <= 3e9
