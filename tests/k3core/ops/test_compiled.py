"""The trainer's compiled regions (k3core.ops.compiled) against their eager torch code.

On CUDA the trainer runs the AttnRes mix, RMSNorm and the KDA gate through torch.compile; here the
compiled forms are built for CPU tensors too (``DEVICES``) and held to the eager references: the
regions alone (outputs and every gradient), and a packed training forward and backward of the small
preset. fp32 throughout, so the only differences are the order of fp32 sums: 1e-5.
"""

import pytest
import torch

import k3core.ops.compiled as regions
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.model.attnres import attn_res_mix, attn_res_mix_reference
from k3core.model.norm import rms_norm, rms_norm_reference
from k3core.ops.kda.gate import kda_gate, kda_gate_reference
from k3core.ops.norms import fused_inference

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(regions, "DEVICES", {"cpu", "cuda"})


def _leaves(*shapes):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


# slow: the first case pays Inductor's C++ compile of every region (37 s of wall time, 24 s of CPU on a clean clone)
@pytest.mark.slow
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_regions_equal_their_references_with_gradients(on_cpu, n_blocks):
    p, *blocks, wg = _leaves(*[(2, 7, 48)] * (n_blocks + 1), (48,))
    x, w = _leaves((5, 48), (48,))
    f, A_log, dt_bias = _leaves((1, 6, 2, 24), (2,), (48,))
    cases = [(attn_res_mix, attn_res_mix_reference, lambda fn: fn(p, blocks, wg, 1e-6), [p, *blocks, wg]),
             (rms_norm, rms_norm_reference, lambda fn: fn(x, w, 1e-6), [x, w]),
             (kda_gate, kda_gate_reference, lambda fn: fn(f, A_log, dt_bias, -5.0), [f, A_log, dt_bias])]
    for fast, ref, call, leaves in cases:
        assert regions.use_compiled(leaves[0])
        outs = []
        for fn in (fast, ref):
            out = call(fn)
            outs.append((out, torch.autograd.grad(out, leaves, torch.ones_like(out) * 0.5 + out.detach())))
        torch.testing.assert_close(outs[0][0], outs[1][0], **TOL)
        for a, b in zip(outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, b, **TOL)
    assert set(regions._CACHE) >= {attn_res_mix_reference, rms_norm_reference, kda_gate_reference}


def test_engine_forwards_and_the_switch_keep_the_eager_path(on_cpu, monkeypatch):
    x = torch.randn(3, 8)
    with fused_inference(True):
        assert not regions.use_compiled(x)
    assert regions.use_compiled(x)
    monkeypatch.setattr(regions, "COMPILED", False)
    assert not regions.use_compiled(x)
    monkeypatch.setattr(regions, "COMPILED", True)
    monkeypatch.setattr(regions, "DEVICES", {"cuda"})
    assert not regions.use_compiled(x)  # the default: CPU tensors run eager


@pytest.mark.slow
def test_a_packed_training_step_equals_the_eager_one(on_cpu, monkeypatch):
    torch.manual_seed(0)
    cfg = K3Config.preset("small")
    model = K3ForCausalLM(cfg)
    model.reset_parameters(0)
    lengths = [5, 40, 17]
    ids = torch.randint(0, 256, (1, sum(lengths)))
    cu = torch.tensor([0, 5, 45, 62], dtype=torch.int32)

    def run():
        model.zero_grad()
        out = model(ids, cu_seqlens=cu, targets=ids.roll(-1, 1), return_logprobs=True)
        out.loss.backward()
        return out.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fast = run()
    monkeypatch.setattr(regions, "COMPILED", False)
    ref = run()
    torch.testing.assert_close(fast[0], ref[0], **TOL)
    assert fast[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(fast[1][name], ref[1][name], **TOL, msg=name)
