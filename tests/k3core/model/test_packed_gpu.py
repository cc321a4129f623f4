"""Packed (varlen) sequences on CUDA: fla's varlen ``chunk_kda`` against k3core's torch chunked KDA on
the same packed batch, and against each sequence run alone. Skipped without a GPU.

Both compare with the experts forced (``forced_routing``): fla's fp32 ``tl.dot`` runs in TF32 on
Hopper, which flips near-tied expert choices of a random-init router, and one flipped expert moves a
log-probability by far more than rounding (see test_model_gpu.py). With routing fixed, what is left
is TF32 rounding, so the tolerance can catch a kernel that crosses a sequence boundary.
"""

import functools

import pytest
import torch

import k3core.model.kda as kda_layer
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.ops.kda import kda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# a token alone, shorter than the conv kernel, exactly one and just over one 64-token chunk, several chunks
LENGTHS = [1, 3, 64, 65, 200, 17]


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _setup():
    torch.manual_seed(0)
    cfg = K3Config.preset("small")
    cpu = K3ForCausalLM(cfg)
    cpu.reset_parameters(0)
    gpu = K3ForCausalLM(cfg).cuda()
    gpu.load_state_dict(cpu.state_dict())
    seqs = [torch.randint(0, 256, (n,)) for n in LENGTHS]
    ids = torch.cat(seqs).unsqueeze(0)
    tgt = torch.cat([s.roll(-1) for s in seqs]).unsqueeze(0)
    # the CPU's own packed routing, replayed on the GPU (the CPU packed path is checked against each
    # sequence alone in test_packed.py)
    with torch.no_grad():
        routing = cpu(ids, cu_seqlens=_cu(LENGTHS), return_routing=True).routing
    return gpu, seqs, ids.cuda(), tgt.cuda(), routing.cuda()


def _packed(model, ids, tgt, routing):
    out = model(ids, cu_seqlens=_cu(LENGTHS), targets=tgt, return_logprobs=True, forced_routing=routing)
    return out.logprobs


def test_packed_fla_varlen_matches_torch_chunk(monkeypatch):
    """The same packed batch through the model twice on CUDA: KDA by fla's varlen kernel (the default
    on CUDA), then by the torch chunked path; log-probabilities and the KDA parameters' gradients."""
    gpu, _, ids, tgt, routing = _setup()
    # the KDA layers' own parameters: their gradient passes through the kernel's backward
    kda_params = [(n, p) for n, p in gpu.named_parameters() if n.endswith(("conv1d.weight", "A_log", "dt_bias"))]
    assert kda_params
    lp_fla = _packed(gpu, ids, tgt, routing)
    g_fla = torch.autograd.grad(lp_fla.sum(), [p for _, p in kda_params])
    monkeypatch.setattr(kda_layer, "kda", functools.partial(kda, backend="torch"))
    lp_torch = _packed(gpu, ids, tgt, routing)
    g_torch = torch.autograd.grad(lp_torch.sum(), [p for _, p in kda_params])
    diff = (lp_fla - lp_torch).abs().max().item()
    torch.testing.assert_close(lp_fla, lp_torch, rtol=1e-2, atol=1e-2, msg=lambda m: f"{m}\nmax |diff| {diff:.3g}")
    for (n, _), a, b in zip(kda_params, g_fla, g_torch):
        rel = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        assert rel < 2e-2, f"{n}: gradient relative error {rel:.3g}"


def test_packed_fla_equals_each_sequence_alone():
    """fla varlen on the packed row against fla on each sequence alone (no ``cu_seqlens``)."""
    gpu, seqs, ids, tgt, routing = _setup()
    with torch.no_grad():
        lp = _packed(gpu, ids, tgt, routing)
        alone, start = [], 0
        for s in seqs:
            n = s.numel()
            x = s.cuda().unsqueeze(0)
            alone.append(gpu(x, targets=x.roll(-1, 1), return_logprobs=True,
                             forced_routing=routing[:, start:start + n]).logprobs)
            start += n
    want = torch.cat(alone, 1)
    diff = (lp - want).abs().max().item()
    torch.testing.assert_close(lp, want, rtol=1e-2, atol=1e-2, msg=lambda m: f"{m}\nmax |diff| {diff:.3g}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_short_conv_fla_matches_the_torch_path(monkeypatch, dtype):
    """fla's varlen causal conv (the CUDA default) against ShortConv's torch path: output, input
    gradient and the fp32 weight gradient, over sequences shorter than the kernel and longer."""
    from k3core.model.varlen import VarlenLayout

    torch.manual_seed(0)
    conv = kda_layer.ShortConv(256, 4).cuda()
    cu = _cu(LENGTHS)
    T = int(cu[-1])
    varlen = VarlenLayout.from_cu_seqlens(cu, T, torch.device("cuda"))
    x = torch.randn(1, T, 256, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(1, T, 256, device="cuda", dtype=dtype)

    def run():
        y = conv.forward_packed(x, varlen)
        return (y, *torch.autograd.grad(y, (x, conv.weight), dy))

    fla = run()
    monkeypatch.setattr(kda_layer, "FLA_SHORT_CONV", False)
    ref = run()
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("y", "dx"), fla, ref):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m, name=name: f"{name}: {m}")
    # dw sums x * dy over every position: its rounding grows with the sum, not with an element that
    # happens to cancel to near zero, so it is bounded against the gradient's scale (on the H100 the bf16
    # case differed by 0.0108 at one element of 1024 whose value was 0.0103: outside an elementwise
    # atol of 1e-2, about 2e-4 of the gradient's largest element).
    (a, b) = fla[2].float(), ref[2].float()
    assert fla[2].dtype == ref[2].dtype
    worst = ((a - b).abs().max() / b.abs().max()).item()
    assert worst < (2e-3 if dtype == torch.bfloat16 else 1e-5), f"dw: max |diff| is {worst:.3g} of max |dw|"


def test_compiled_trainer_regions_match_eager_on_cuda(monkeypatch):
    """The trainer's CUDA default compiles the AttnRes mix, RMSNorm and the KDA gate
    (k3core.ops.compiled): the packed batch's log-probabilities and every gradient against the
    eager regions, fp32 weights, routing forced."""
    import k3core.ops.compiled as regions

    gpu, _, ids, tgt, routing = _setup()

    def run():
        gpu.zero_grad()
        logp = _packed(gpu, ids, tgt, routing)
        logp.sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in gpu.named_parameters() if p.grad is not None}

    fast = run()
    assert regions._CACHE, "no region was compiled"
    monkeypatch.setattr(regions, "COMPILED", False)
    ref = run()
    # The compiled regions sum in another order (fp32 rounding), and fla's KDA kernels after them run
    # their fp32 dots in TF32, which turns those last-bit differences into TF32-sized ones: on the H100
    # the log-probabilities differed by at most 1.8e-4 relative (9.9e-4 absolute) on 9 of 350, and the
    # largest gradient difference was A_log's, 4.1e-3 relative: its gradient sums over every position
    # and head through those TF32 dots. The bounds are a tenth (log-probabilities) and half (gradients)
    # of what fla against the torch KDA path may differ by (the test above).
    torch.testing.assert_close(fast[0], ref[0], rtol=1e-3, atol=1e-3)
    for name, g in ref[1].items():
        rel = ((fast[1][name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 1e-2, f"{name}: gradient relative error {rel:.3g}"
