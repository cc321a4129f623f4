"""The routed-expert grouped matmuls inside a CUDA graph (marked ``gpu``; skipped without CUDA):
captured once on one routing, replayed on other routings and inputs written into the same buffers,
against the same call run eagerly on those inputs.

This is what graph-mode decode relies on: a decode step's routing changes every step, its shapes do
not. Two kernels are checked, the ones a captured decode step runs:
- bf16 float experts on sm90: ``torch._grouped_mm`` with device offsets (``RoutedExperts.grouped_forward``
  with ``max_rows``), the only bf16-only kernel in the captured step, and the first suspect for the
  bf16 graph-mode failure in docs/results/gpu_tests.md;
- W4A8 experts: the Triton kernel with its tile table built on the device (``device_tiles``).
A replay that read stale offsets, a stale tile table or a buffer copied at capture would give the
capture routing's answer: the routings here differ in every expert's row count."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, K, I, N = 8, 256, 128, 48  # experts, latent width, expert width, rows (tokens x top-k)


def _counts(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, N + 1, (E - 1,), generator=g)).values
    return torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([N])])).cuda()


def _replays_match_eager(fn, x_static, counts_static, tol):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture (allocations, autotuning, lazy init)
        for _ in range(2):
            fn(x_static, counts_static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = fn(x_static, counts_static)
    for seed in (1, 2, 3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(x_static.shape, generator=g, device="cuda").to(x_static.dtype)
        counts = _counts(seed)
        x_static.copy_(x)
        counts_static.copy_(counts)
        graph.replay()
        torch.cuda.synchronize()
        want = fn(x, counts)
        torch.testing.assert_close(out_static, want, **tol, msg=lambda m, c=counts: f"counts {c.tolist()}: {m}")


def test_bf16_grouped_mm_experts_replay_in_a_cuda_graph():
    from k3core.model.moe import RoutedExperts, _grouped_mm_ok

    torch.manual_seed(0)
    ex = RoutedExperts(E, K, I, 4.0, 25.0).cuda()
    with torch.no_grad():
        ex.w13.normal_(0, K ** -0.5)
        ex.w2.normal_(0, I ** -0.5)
    ex = ex.to(torch.bfloat16)
    x = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    if not _grouped_mm_ok(x, ex.w13):
        pytest.skip("torch._grouped_mm does not apply on this GPU (sm90+ and bf16 only)")
    with torch.no_grad():
        # eager and replay run the same kernels on the same inputs: equal to bf16 rounding at most
        _replays_match_eager(lambda a, c: ex.grouped_forward(a, c, max_rows=N), x, _counts(0),
                             dict(rtol=1e-2, atol=1e-2))


def test_w4a8_experts_replay_in_a_cuda_graph():
    from k3core.model.moe import RoutedExperts
    from k3core.ops.w4a8 import triton_available
    from k3core.rollout.quantized import W4A8Experts

    assert triton_available(), "CUDA without triton: the W4A8 kernel cannot run"
    torch.manual_seed(0)
    ex = RoutedExperts(E, K, I, 4.0, 25.0).cuda()
    with torch.no_grad():
        ex.w13.normal_(0, K ** -0.5)
        ex.w2.normal_(0, I ** -0.5)
    q = W4A8Experts.from_experts(ex, act_granularity="token")
    x = torch.randn(N, K, device="cuda")
    with torch.no_grad():
        _replays_match_eager(q.grouped_forward, x, _counts(0), dict(rtol=1e-5, atol=1e-5))
