"""The model on CUDA (fla KDA kernels, grouped-GEMM experts, Triton SiTU) against the same weights
on the CPU torch paths. Skipped without a GPU."""

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3Cache, K3ForCausalLM
from k3core.model.moe import LatentMoE, dense_reference_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def test_small_model_cuda_matches_cpu_fp32():
    """The GPU forward against the CPU's with the CPU's expert choices replayed (``forced_routing``):
    a random-init router has near-ties that TF32 rounding (fla's fp32 ``tl.dot`` on Hopper) flips,
    and one flipped expert moves a logprob by far more than rounding does. With routing fixed, what
    is left is rounding, so the tolerance can be tight enough to catch a wrong kernel. The free
    (unreplayed) GPU routing's agreement with the CPU's is reported in the message for diagnosis."""
    torch.manual_seed(0)
    cfg = K3Config.preset("small")
    cpu = K3ForCausalLM(cfg)
    cpu.reset_parameters(0)
    gpu = K3ForCausalLM(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, 256, (2, 100))
    a = cpu(ids, targets=ids.roll(-1, 1), return_logprobs=True, return_routing=True)
    free = gpu(ids.cuda(), targets=ids.roll(-1, 1).cuda(), return_logprobs=True, return_routing=True)
    b = gpu(ids.cuda(), targets=ids.roll(-1, 1).cuda(), return_logprobs=True, forced_routing=a.routing.cuda())
    same = _agreement(free.routing.cpu(), a.routing)
    diff = (b.logprobs.cpu() - a.logprobs).abs().max().item()
    free_diff = (free.logprobs.cpu() - a.logprobs).abs().max().item()
    torch.testing.assert_close(b.logprobs.cpu(), a.logprobs, rtol=1e-2, atol=1e-2, msg=lambda m: (
        f"{m}\nwith the CPU's routing replayed: max |diff| {diff:.3g}; free GPU routing: {same:.1%} of expert "
        f"choices equal the CPU's, max |diff| {free_diff:.3g}"))
    b.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)


def test_bf16_cuda_cached_decode_tracks_full_forward():
    """Cached decode (prefill 20 tokens, then one at a time) against the no-cache forward, both in
    bf16 with the no-cache forward's expert choices replayed, so only the cache path's numerics
    are compared (near-tie flips between two bf16 computations are not a cache bug)."""
    torch.manual_seed(0)
    cfg = K3Config.preset("small")
    m = K3ForCausalLM(cfg).cuda().cast(torch.bfloat16).eval()
    m.use_inference_caches = True
    m.refresh_inference_caches()
    ids = torch.randint(0, 256, (4, 40), device="cuda")
    with torch.no_grad():
        ref = m(ids, return_routing=True)
        full, routing = ref.logits.float(), ref.routing
        cache = K3Cache.empty(cfg)
        steps = [m(ids[:, :20], cache=cache, forced_routing=routing[:, :20]).logits[:, -1]]
        for t in range(20, 40):
            steps.append(m(ids[:, t:t + 1], cache=cache, forced_routing=routing[:, t:t + 1]).logits[:, -1])
        cache = K3Cache.empty(cfg)  # the same decode with its own routing, for the message
        free = [m(ids[:, :20], cache=cache).logits[:, -1]] + [m(ids[:, t:t + 1], cache=cache).logits[:, -1]
                                                              for t in range(20, 39)]
    got = torch.stack(steps[:-1], 1).float()
    free_diff = (torch.stack(free, 1).float() - full[:, 19:39]).abs().max().item()
    torch.testing.assert_close(got, full[:, 19:39], rtol=5e-2, atol=5e-2, msg=lambda m: (
        f"{m}\nwith the no-cache routing replayed; free routing: max |diff| {free_diff:.3g}"))


def test_grouped_mm_experts_match_dense_reference_bf16():
    torch.manual_seed(0)
    cfg = K3Config.preset("medium").replace(num_hidden_layers=2)
    moe = LatentMoE(cfg).cuda().to(torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    x = torch.randn(512, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    y, _ = moe(x)
    torch.testing.assert_close(y.float(), dense_reference_moe(moe, x).float(), rtol=3e-2, atol=3e-2)
