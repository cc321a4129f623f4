"""The single-device memory ledger (``k3core.plan.device_ledger``) against the bytes of the actual
tensors of the tiny preset: trainer parameters and gradients, StreamedAdamW's host state, the W4A8
engine's parameters and buffers (AttnRes cache included), and the static decode state."""

import copy

import pytest
import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.model.cache import StaticDecodeState
from k3core.plan import device_ledger, static_decode_state_bytes
from k3core.rl.trainer_state import make_optimizer
from k3core.rl.weights import engine_from_model

TINY = K3Config.preset("tiny")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ledger_equals_the_tiny_models_tensor_bytes(dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    model = K3ForCausalLM(TINY)
    model.reset_parameters(0)
    engine = engine_from_model(copy.deepcopy(model).cast(dtype), 0, quantized=True)
    model.cast(dtype)
    ids = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))  # every expert gets rows
    model(ids[:, :-1], targets=ids[:, 1:]).loss.backward()
    opt = make_optimizer(model, 1e-3)
    ledger = device_ledger(TINY, trainer_dtype_bytes=size, engine_dtype_bytes=size, sequences=3, context=40)

    assert ledger["trainer_weights"] == _nbytes(model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None for p in trainable)  # the batch reaches every trainable parameter
    assert ledger["trainer_gradients"] == _nbytes(p.grad for p in trainable)
    assert ledger["trainer_buffers"] == _nbytes(model.buffers())
    assert ledger["host_optimizer_state"] == opt.host_bytes()["state"] == 8 * sum(p.numel() for p in trainable)
    assert ledger["engine_weights"] == _nbytes(engine.model.parameters()) + _nbytes(engine.model.buffers())
    state = StaticDecodeState(TINY, 3, 40, dtype, "cpu")
    assert ledger["engine_decode_state"] == _nbytes(state.buffers())


def test_mxfp4_engine_is_smaller_than_float_and_decode_state_grows_with_mla_only():
    q = device_ledger(TINY, quantized=True)["engine_weights"]
    f = device_ledger(TINY, quantized=False)["engine_weights"]
    routed = K3ForCausalLM(TINY).model.layers[1].block_sparse_moe.experts.w13.numel() * 3  # 3 MoE layers, w13
    assert f - q > 4 * routed - routed * (0.5 + 1 / 32)  # w13 alone saves this much (w2 adds more)
    n_mla = sum(TINY.layer_type(i) == "mla" for i in range(TINY.num_hidden_layers))
    per_token = 4 * (TINY.kv_lora_rank + TINY.qk_rope_head_dim) * n_mla
    assert static_decode_state_bytes(TINY, 5, 101, 4) - static_decode_state_bytes(TINY, 5, 100, 4) == 5 * per_token
