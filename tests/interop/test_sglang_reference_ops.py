"""SGLang's own torch reference paths against k3rl's, on random inputs: the AttnRes mix
(``aggregate_stream_torch`` with SGLang's ``RMSNorm``/``ReplicatedLinear`` modules, and its ``get_cw``
score vector), the MXFP4 dequantize utility (``MXFP4QuantizeUtil.dequantize``), the biased grouped top-k
routing (``biased_grouped_topk_impl`` and the K2/K3 single-group ``kimi_k2_biased_topk_impl``) and SiTU
(``SituAndMul.forward_native``). SGLang's CUDA kernels for the same operations cannot run here."""

from __future__ import annotations

import pytest
import torch

import sglang_cpu
from k3core.model.attnres import ResNorm, ResProj, attn_res_mix, w_gamma
from k3core.model.moe import select_experts
from k3core.ops.mxfp4 import dequantize, quantize
from k3core.ops.situ.naive import situ_glu_reference


@pytest.fixture(scope="module")
def sg():
    sglang_cpu.install_cpu_stubs()
    import sglang.srt.layers.activation as activation
    import sglang.srt.layers.attn_residual as attn_residual
    import sglang.srt.layers.layernorm as layernorm
    import sglang.srt.layers.linear as linear
    import sglang.srt.layers.moe.topk as topk
    import sglang.srt.layers.quantization.mxfp4_tensor as mxfp4_tensor

    return dict(activation=activation, attn_residual=attn_residual, layernorm=layernorm, linear=linear,
                topk=topk, mxfp4_tensor=mxfp4_tensor)


def _eager(fn):
    """SGLang wraps its routing functions in ``torch.compile``; on a CPU without a compiler toolchain the
    function itself (the same code, eager) is what runs."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _sglang_attnres_modules(sg, H, eps, dtype, w, gamma):
    proj = sg["linear"].ReplicatedLinear(H, 1, bias=False, params_dtype=dtype)
    norm = sg["layernorm"].RMSNorm(H, eps=eps)
    with torch.no_grad():
        proj.weight.copy_(w.to(dtype))
        norm.weight.data = gamma.to(dtype)
    return proj, norm


@pytest.mark.parametrize("nvb", [1, 3])
def test_attnres_mix_matches_sglang(sg, nvb):
    torch.manual_seed(nvb)
    T, H, eps = 5, 96, 1e-5
    w = torch.randn(1, H).bfloat16()
    gamma = (1 + 0.3 * torch.randn(H)).bfloat16()
    bank = (torch.randn(T, nvb + 2, H) * 3).bfloat16()  # more rows than valid: only nvb are read
    prefix = torch.randn(T, H).bfloat16()
    # fp32: the same mathematics, to rounding
    proj32, norm32 = _sglang_attnres_modules(sg, H, eps, torch.float32, w, gamma)
    exact = sg["attn_residual"].aggregate_stream_torch(prefix.float(), bank.float(), nvb, proj32, norm32)
    ours32 = attn_res_mix(prefix.float(), [bank[:, j].float() for j in range(nvb)], w[0].float() * gamma.float(), eps)
    torch.testing.assert_close(ours32, exact, atol=1e-5, rtol=1e-5)
    # bf16 activations: SGLang rounds the normed rows and scores to bf16, k3rl scores in fp32; k3rl's
    # result is no further from the fp32 mixture than SGLang's own bf16 result is
    proj, norm = _sglang_attnres_modules(sg, H, eps, torch.bfloat16, w, gamma)
    theirs = sg["attn_residual"].aggregate_stream_torch(prefix, bank, nvb, proj, norm)
    k3_proj, k3_norm = ResProj(H).bfloat16(), ResNorm(H).bfloat16()
    with torch.no_grad():
        k3_proj.weight.copy_(w)
        k3_norm.weight.copy_(gamma)
    ours = attn_res_mix(prefix, [bank[:, j] for j in range(nvb)], w_gamma(k3_proj, k3_norm), eps)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    err_ours = (ours.float() - exact).abs().max()
    err_theirs = (theirs.float() - exact).abs().max()
    assert err_ours <= err_theirs + 1e-2, (err_ours, err_theirs)
    # the cached score vector SGLang's kernels read is k3rl's w * gamma
    torch.testing.assert_close(sg["attn_residual"].get_cw(proj, norm), w_gamma(k3_proj, k3_norm), atol=0, rtol=0)


def test_mxfp4_dequantize_matches_sglang(sg):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.logspace(-3, 2, 48).unsqueeze(1)
    packed, scale = quantize(w)
    ours = dequantize(packed, scale, torch.float32)
    theirs = sg["mxfp4_tensor"].MXFP4QuantizeUtil.dequantize(
        quantized_data=packed, dtype=torch.float32, scale=scale, block_sizes=[32])
    torch.testing.assert_close(ours, theirs.reshape(ours.shape), atol=0, rtol=0)


@pytest.mark.parametrize("groups,topk_groups", [(1, 1), (4, 2)])
def test_biased_grouped_topk_matches_sglang(sg, groups, topk_groups):
    torch.manual_seed(groups)
    N, E, k = 64, 32, 6
    logits = torch.randn(N, E)
    bias = 0.5 * torch.randn(E)
    hidden = torch.empty(N, 8)
    w_theirs, ids_theirs = _eager(sg["topk"].biased_grouped_topk_impl)(
        hidden, logits, bias, topk=k, renormalize=True, num_expert_group=groups, topk_group=topk_groups)
    scores = torch.sigmoid(logits)
    ids = select_experts(scores + bias, k, groups, topk_groups)
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True)
    order_ours, order_theirs = ids.sort(-1), ids_theirs.long().sort(-1)
    assert torch.equal(order_ours.values, order_theirs.values)
    torch.testing.assert_close(w.gather(1, order_ours.indices), w_theirs.gather(1, order_theirs.indices))
    if groups == 1:  # the single-group path SGLang takes for K2/K3 routers
        w1, ids1 = _eager(sg["topk"].kimi_k2_biased_topk_impl)(hidden, logits, bias, topk=k, renormalize=True)
        assert torch.equal(ids1.long().sort(-1).values, order_ours.values)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_situ_matches_sglang(sg, dtype, tol):
    torch.manual_seed(1)
    x = (torch.randn(7, 2 * 40) * 20).to(dtype)  # past both soft clips (beta 4, linear beta 25)
    act = sg["activation"].SituAndMul(beta=4.0, linear_beta=25.0)
    torch.testing.assert_close(situ_glu_reference(x, 4.0, 25.0), act.forward_native(x), atol=tol, rtol=tol)
