"""The fused inference kernels of ``k3core.ops.norms`` against the torch paths they replace
(``k3core.model.norm.rms_norm``, ``k3core.model.attnres.attn_res_mix``): under the Triton interpreter
on the CPU, compiled on a GPU; and the dispatch (fused only on CUDA with no gradient to record)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

CASES = textwrap.dedent("""
    import torch
    from k3core.model.attnres import attn_res_mix
    from k3core.model.norm import rms_norm
    from k3core.ops.norms import fused_triton as F
    dev = "{device}"
    g = torch.Generator().manual_seed(0)
    tol = {{torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}}
    for dt in (torch.float32, torch.bfloat16):
        # rows of every width the model normalises (head 128, latent 768, hidden 1536), odd widths,
        # a non-contiguous row view, rows of zeros
        for shape in ((5, 96), (2, 3, 4, 128), (7, 1536), (1, 33), (3, 768)):
            x = (torch.randn(*shape, generator=g) * 3).to(device=dev, dtype=dt)
            x[0] = 0
            w = torch.randn(shape[-1], generator=g).to(device=dev, dtype=dt)
            for ww in (w, None):
                a, b = F.rms_norm(x, ww, 1e-6), rms_norm(x, ww, 1e-6)
                assert a.dtype == b.dtype == dt and a.shape == b.shape
                torch.testing.assert_close(a.float(), b.float(), **tol[dt])
        xt = torch.randn(64, 6, generator=g).to(device=dev, dtype=dt).t()
        torch.testing.assert_close(F.rms_norm(xt, None, 1e-6).float(), rms_norm(xt, None, 1e-6).float(), **tol[dt])
        # the mix over 1..6 candidates of different scales, scores far apart (one candidate takes all)
        # and equal (a plain average)
        for C, wscale in ((1, 1.0), (2, 1.0), (5, 1.0), (6, 50.0), (4, 0.0)):
            p = (torch.randn(3, 4, 1536, generator=g) * 2).to(device=dev, dtype=dt)
            blocks = [(torch.randn(3, 4, 1536, generator=g) * (i + 1)).to(device=dev, dtype=dt) for i in range(C - 1)]
            wg = (torch.randn(1536, generator=g) * wscale).to(dev)
            a, b = F.attn_res_mix(p, blocks, wg, 1e-6), attn_res_mix(p, blocks, wg, 1e-6)
            assert a.dtype == b.dtype == dt and a.shape == b.shape
            torch.testing.assert_close(a.float(), b.float(), **tol[dt])
    print("ok")
""")


def test_fused_norms_match_the_torch_paths_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", CASES.format(device="cpu")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


def test_the_fused_path_is_taken_only_in_engine_forwards_on_cuda_without_a_gradient_to_record():
    import k3core.ops.norms as N

    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM

    x = torch.randn(2, 8)
    with N.fused_inference():
        assert not N.use_fused(x)  # CPU: the torch path
    # an engine model's forward is inside fused_inference, a trainer's is not
    seen = []
    real = N.use_fused
    m = K3ForCausalLM(K3Config.preset("tiny")).eval()
    ids = torch.randint(0, 200, (1, 4))
    try:
        N.use_fused = lambda *t: seen.append(N._IN_ENGINE.get()) or False
        import k3core.model.norm as norm_mod
        norm_mod.use_fused = N.use_fused
        with torch.no_grad():
            m(ids)
            trainer = set(seen)
            seen.clear()
            m.use_inference_caches = True
            m.refresh_inference_caches()
            m(ids)
    finally:
        N.use_fused = norm_mod.use_fused = real
    assert trainer == {False} and set(seen) == {True}
    if not torch.cuda.is_available():
        return
    xc = x.cuda()
    w = torch.ones(8, device="cuda", requires_grad=True)
    assert not N.use_fused(xc)  # outside an engine forward
    with N.fused_inference():
        assert N.use_fused(xc) == N.fused_available()
        assert not N.use_fused(xc, w)  # autograd records through the torch path
        with torch.no_grad():
            assert N.use_fused(xc, w) == N.fused_available()
        assert not N.use_fused(xc.double())
        N.FUSED = False
        try:
            assert not N.use_fused(xc)
        finally:
            N.FUSED = True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_norms_match_the_torch_paths_on_gpu():
    import k3core.ops.norms as N

    assert N.fused_available(), "CUDA without triton: the fused norms cannot run"
    N.FUSED = False  # the references inside CASES must be the torch paths
    try:
        exec(CASES.format(device="cuda"), {})
    finally:
        N.FUSED = True
