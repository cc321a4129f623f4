"""QAT of routed experts: the forward is the model whose expert weights were replaced by their MXFP4
round trip, the gradient is the straight-through closed form, and export still writes the public names."""

import copy
import json

import pytest
import torch

from k3core.checkpoint.hf import load_hf, save_hf
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.model.moe import RoutedExperts
from k3core.ops.mxfp4 import dequantize, quantize

TINY = K3Config.preset("tiny")


def _pair(seed=0):
    """(QAT model, plain model whose routed experts hold the MXFP4 round trip of the same weights)."""
    torch.manual_seed(seed)
    qat = K3ForCausalLM(TINY.replace(qat_routed_experts=True))
    qat.reset_parameters(seed)
    ref = K3ForCausalLM(TINY)
    ref.load_state_dict(qat.state_dict())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith((".experts.w13", ".experts.w2")):
                p.copy_(dequantize(*quantize(p), dtype=p.dtype))
    return qat, ref


def test_qat_switch_reaches_every_routed_expert_stack():
    qat, ref = _pair()
    flags = [m.qat for m in qat.modules() if isinstance(m, RoutedExperts)]
    assert flags and all(flags)
    assert not any(m.qat for m in ref.modules() if isinstance(m, RoutedExperts))


def test_forward_equals_model_with_round_tripped_expert_weights():
    qat, ref = _pair()
    ids = torch.randint(0, 256, (2, 9))
    a, b = qat(ids, return_routing=True), ref(ids, return_routing=True)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.routing, b.routing)
    # and QAT really changes the forward: the master weights alone give other logits
    plain = K3ForCausalLM(TINY)
    plain.load_state_dict(qat.state_dict())
    assert not torch.allclose(plain(ids).logits, a.logits)


def test_gradient_is_straight_through():
    """d loss / d w (QAT, master weights) == d loss / d w_hat (round-tripped weights as leaves)."""
    qat, ref = _pair(1)
    ids = torch.randint(0, 256, (3, 8))
    qat(ids, targets=ids.roll(-1, 1)).loss.backward()
    ref(ids, targets=ids.roll(-1, 1)).loss.backward()
    ga, gb = dict(qat.named_parameters()), dict(ref.named_parameters())
    experts = [n for n in ga if n.endswith((".experts.w13", ".experts.w2"))]
    assert experts
    for n in ga:
        if ga[n].grad is None:
            assert gb[n].grad is None, n
            continue
        assert torch.equal(ga[n].grad, gb[n].grad), n
    assert any(ga[n].grad.abs().sum() > 0 for n in experts)


def test_export_writes_public_names_and_what_qat_trained(tmp_path):
    qat, ref = _pair(2)
    a = save_hf(qat, tmp_path / "qat_bf16", target="bf16")
    b = save_hf(K3ForCausalLM(TINY, init_weights=False), tmp_path / "plain_bf16", config=TINY, target="bf16")
    idx = lambda p: set(json.loads((p / "model.safetensors.index.json").read_text())["weight_map"])  # noqa: E731
    assert idx(a.path) == idx(b.path)
    assert any(k.endswith("experts.0.w1.weight") for k in idx(a.path))
    # the flag is a runtime switch: config.json does not carry it
    text = json.loads((a.path / "config.json").read_text())["text_config"]
    assert "qat_routed_experts" not in text
    # the MXFP4 export of the QAT model stores exactly the weights its forward used
    save_hf(qat, tmp_path / "qat_mx", target="mxfp4")
    loaded = load_hf(tmp_path / "qat_mx", dtype=torch.float32)
    for name, p in ref.named_parameters():
        if name.endswith((".experts.w13", ".experts.w2")):
            assert torch.equal(loaded[name], p.detach()), name


def test_config_validates_the_flag_and_hf_round_trip_drops_it():
    with pytest.raises(ValueError, match="qat_routed_experts must be true or false"):
        TINY.replace(qat_routed_experts="yes")
    with pytest.raises(ValueError, match="multiple of 32 for MXFP4 QAT"):
        TINY.replace(qat_routed_experts=True, moe_intermediate_size=40)
    on = TINY.replace(qat_routed_experts=True)
    d = on.to_hf_dict()
    assert "qat_routed_experts" not in d["text_config"]
    d["text_config"]["qat_routed_experts"] = True  # a hand-edited file cannot switch training
    assert K3Config.from_hf_dict(d).qat_routed_experts is False
    assert copy.deepcopy(on).replace(hidden_size=64).qat_routed_experts is True
