"""The model on CUDA (fla KDA kernels, grouped-GEMM experts, Triton SiTU) against the same weights
on the CPU torch paths. Skipped without a GPU."""

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3Cache, K3ForCausalLM
from k3core.model.moe import LatentMoE, dense_reference_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_small_model_cuda_matches_cpu_fp32():
    torch.manual_seed(0)
    cfg = K3Config.preset("small")
    cpu = K3ForCausalLM(cfg)
    cpu.reset_parameters(0)
    gpu = K3ForCausalLM(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, 256, (2, 100))
    a = cpu(ids, targets=ids.roll(-1, 1), return_logprobs=True)
    b = gpu(ids.cuda(), targets=ids.roll(-1, 1).cuda(), return_logprobs=True)
    # fla computes in fp32 with tf32-free kernels; allow accumulation-order differences
    torch.testing.assert_close(b.logprobs.cpu(), a.logprobs, rtol=2e-3, atol=2e-3)
    b.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)


def test_bf16_cuda_cached_decode_tracks_full_forward():
    torch.manual_seed(0)
    cfg = K3Config.preset("small")
    m = K3ForCausalLM(cfg).cuda().cast(torch.bfloat16).eval()
    m.use_inference_caches = True
    m.refresh_inference_caches()
    ids = torch.randint(0, 256, (4, 40), device="cuda")
    with torch.no_grad():
        full = m(ids).logits.float()
        cache = K3Cache.empty(cfg)
        steps = [m(ids[:, :20], cache=cache).logits[:, -1]]
        for t in range(20, 40):
            steps.append(m(ids[:, t:t + 1], cache=cache).logits[:, -1])
    got = torch.stack(steps[:-1], 1).float()
    torch.testing.assert_close(got, full[:, 19:39], rtol=5e-2, atol=5e-2)


def test_grouped_mm_experts_match_dense_reference_bf16():
    torch.manual_seed(0)
    cfg = K3Config.preset("medium").replace(num_hidden_layers=2)
    moe = LatentMoE(cfg).cuda().to(torch.bfloat16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    x = torch.randn(512, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    y, _ = moe(x)
    torch.testing.assert_close(y.float(), dense_reference_moe(moe, x).float(), rtol=3e-2, atol=3e-2)
