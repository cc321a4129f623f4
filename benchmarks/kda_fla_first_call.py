"""fla KDA first-call cost on CUDA: times the first and second chunk_kda forward+backward per shape
(the first pays Triton autotuning). Run on a GPU with fla installed:
``TRITON_PRINT_AUTOTUNING=1 python3 benchmarks/kda_fla_first_call.py``. Results: docs/results/gpu_h200.md.
With k3core's shipped configs and three cases in fresh processes: benchmarks/kda_first_call.py."""
import time

t0 = time.time()
import fla.ops.kda as m  # noqa: E402 (the import is what is timed)
import torch  # noqa: E402

print("import fla", round(time.time() - t0, 1), flush=True)
dev = "cuda"
def run(T, H, K, safe, gate_in_kernel, bwd):
    torch.manual_seed(0)
    q = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16, requires_grad=bwd)
    k = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16, requires_grad=bwd)
    v = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16, requires_grad=bwd)
    beta = torch.rand(1, T, H, device=dev, dtype=torch.float32).requires_grad_(bwd)
    kw = {}
    if gate_in_kernel:
        g = torch.randn(1, T, H, K, device=dev, dtype=torch.float32, requires_grad=bwd)
        kw = dict(use_gate_in_kernel=True, A_log=torch.zeros(H, device=dev), dt_bias=torch.zeros(H * K, device=dev), lower_bound=-5.0)
    else:
        g = (-torch.rand(1, T, H, K, device=dev, dtype=torch.float32) * 0.5).requires_grad_(bwd)
    for it in range(2):
        t = time.time()
        o, _ = m.chunk_kda(q=q, k=k, v=v, g=g, beta=beta, scale=K ** -0.5, use_qk_l2norm_in_kernel=True, safe_gate=safe, **kw)
        torch.cuda.synchronize()
        tf = time.time() - t
        if bwd:
            t = time.time()
            o.float().sum().backward()
            torch.cuda.synchronize()
            tb = time.time() - t
        else:
            tb = 0
        print(f"T={T} H={H} K={K} safe={safe} gate_in_kernel={gate_in_kernel} it{it}: fwd {tf:.2f}s bwd {tb:.2f}s", flush=True)
for args in [(64, 2, 64, True, True, True), (8192, 96, 128, True, True, True)]:
    run(*args)
print("done", flush=True)
