"""The W4A8 rollout engine: routed experts from packed MXFP4 bytes with FP8 activations, swapped in place,
loaded straight from an MXFP4 checkpoint, and updated by a weight transfer under stable buffer names."""

import copy

import pytest
import torch

from k3core.checkpoint.hf import save_hf
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.model.moe import RoutedExperts
from k3core.ops.mxfp4 import dequantize, quantize
from k3core.ops.situ import situ_glu
from k3core.ops.w4a8 import quantize_fp8_reference
from k3core.rl.weights import build_engine, engine_from_model, engine_state
from k3core.rollout.engine import SamplingParams
from k3core.rollout.quantized import (EXPERT_BUFFERS, W4A8Experts, expert_format, load_w4a8_model,
                                      packed_expert_state, quantize_engine_model)

TINY = K3Config.preset("tiny")


def _model(seed=0):
    torch.manual_seed(seed)
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    return m


@pytest.mark.parametrize("granularity", ["token", "block32", None])
def test_experts_match_fp64_dequantise_then_multiply(granularity):
    g = torch.Generator().manual_seed(0)
    E, Dl, I = 4, 64, 32
    dense = RoutedExperts(E, Dl, I, 4.0, 25.0)
    with torch.no_grad():
        dense.w13.normal_(0, 0.2, generator=g)
        dense.w2.normal_(0, 0.2, generator=g)
    experts = W4A8Experts.from_experts(dense, granularity)
    counts = torch.tensor([2, 0, 5, 3])
    x = torch.randn(10, Dl, generator=g)
    got = experts.grouped_forward(x, counts).double()

    def act(t):  # what the engine feeds a matmul, in fp64
        return t.double() if granularity is None else torch.mul(*quantize_fp8_reference(t, granularity))

    start = 0
    for e, n in enumerate(counts.tolist()):
        w13 = dequantize(*quantize(dense.w13[e].detach()), dtype=torch.float32).double()
        w2 = dequantize(*quantize(dense.w2[e].detach()), dtype=torch.float32).double()
        h = situ_glu(act(x[start:start + n]) @ w13.t(), 4.0, 25.0)
        want = act(h.float()) @ w2.t()
        torch.testing.assert_close(got[start:start + n], want, rtol=1e-4, atol=1e-5)
        start += n


def test_quantize_engine_model_keeps_packed_bytes_only():
    m = _model()
    floats_before = sum(p.numel() for p in m.parameters())
    expert_weights = sum(p.numel() for n, p in m.named_parameters() if n.endswith((".experts.w13", ".experts.w2")))
    quantize_engine_model(m)
    assert expert_format(m) == "w4a8"
    assert not any(n.endswith((".experts.w13", ".experts.w2")) for n, _ in m.named_parameters())
    assert sum(p.numel() for p in m.parameters()) == floats_before - expert_weights
    packed = {n: b for n, b in m.named_buffers() if n.rsplit(".", 1)[-1] in EXPERT_BUFFERS}
    assert len(packed) == 4 * len(TINY.moe_layers) and all(b.dtype == torch.uint8 for b in packed.values())
    assert sum(b.numel() for b in packed.values()) == expert_weights // 2 + expert_weights // 32
    with pytest.raises(ValueError, match="already"):
        quantize_engine_model(m)


def test_weight_only_engine_equals_float_model_with_round_tripped_experts():
    """act_granularity=None (W4A16): the only change is the MXFP4 weights, so logits match a float model
    holding dequantize(quantize(w)); the W4A8 engine adds FP8 activation error on top."""
    m = _model(1)
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith((".experts.w13", ".experts.w2")):
                p.copy_(dequantize(*quantize(p), dtype=p.dtype))
    ids = torch.randint(0, 256, (2, 7))
    want = ref(ids).logits
    w4a16 = quantize_engine_model(copy.deepcopy(m), None)
    torch.testing.assert_close(w4a16(ids).logits, want, rtol=1e-5, atol=1e-5)
    w4a8 = quantize_engine_model(copy.deepcopy(m), "token")
    diff = (w4a8(ids).logits - want).abs().max()
    assert 0 < diff < 0.05


def test_load_from_mxfp4_checkpoint_copies_the_stored_bytes(tmp_path):
    m = _model(2)
    save_hf(m, tmp_path / "mx", target="mxfp4")
    loaded = load_w4a8_model(tmp_path / "mx")
    # the same model quantised in memory: non-expert tensors as the bf16 file stores them
    want = copy.deepcopy(m)
    with torch.no_grad():
        for n, p in want.named_parameters():
            if not n.endswith((".experts.w13", ".experts.w2", "A_log", "dt_bias", "conv1d.weight", "o_norm.weight")):
                p.copy_(p.bfloat16().float())
    quantize_engine_model(want)
    a, b = loaded.state_dict(), want.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    eng = build_engine(tmp_path / "mx", 0)
    assert expert_format(eng.model) == "w4a8"
    assert expert_format(build_engine(tmp_path / "mx", 0, w4a8=False).model) == "bf16"


def test_transfer_updates_packed_buffers_by_name():
    trainer = _model(3)
    eng = engine_from_model(copy.deepcopy(trainer), 0, quantized=True)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sd = engine_state(trainer, quantize_experts=True)
    assert sd.keys() == eng.model.state_dict().keys()
    eng.load_weights(sd, 1)
    fresh = engine_from_model(copy.deepcopy(trainer), 1, quantized=True)
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        assert torch.equal(eng.model(ids).logits, fresh.model(ids).logits)
    name = f"model.layers.{TINY.moe_layers[0]}.block_sparse_moe.experts.w13_packed"
    assert torch.equal(eng.model.state_dict()[name], packed_expert_state(trainer.state_dict())[name])
    with pytest.raises(ValueError, match="refused"):  # a float state cannot go into a W4A8 engine
        eng.load_weights(engine_state(trainer, quantize_experts=False), 2)
    assert eng.weight_version == 1


def test_w4a8_engine_generates():
    eng = engine_from_model(_model(4), 0, quantized=True)
    out = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4, seed=0, n=2), pad_id=TINY.pad_token_id)
    assert len(out) == 4 and all(1 <= len(c.output_ids) <= 4 and len(c.logprobs) == len(c.output_ids) for c in out)
