"""Weight transfer (k3core.transfer): digests, the in-process path and the disk path, tiny preset.

The reference for every path: the trainer itself (engine logprobs bit-equal to the trainer's on a
fixed batch) or, with MXFP4 experts, an engine loaded with ``stages.engine_state(quantize_experts=True)``
in process; for ``sum64``, its plain definition (``k3core.transfer.naive``). Refusals (stale
version, wrong dtype, corrupt shard) must leave the old version answering. The cross-process path
(shared-memory stream) is ``test_transfer_stream.py``; CUDA IPC is ``test_transfer_gpu.py``.
"""

import pytest
import torch

from k3core import transfer as T
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.weights import engine_from_model, engine_state
from k3core.rollout.engine import SamplingParams
from k3core.transfer.digest import tensor_digest
from k3core.transfer.naive import sum64_reference

TINY = K3Config.preset("tiny")
IDS = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(7))


def _model(seed: int, dtype=torch.float32) -> K3ForCausalLM:
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    with torch.no_grad():  # AttnRes projections start at zero: make them matter
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return m.cast(dtype)


def _logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[:, :-1], targets=IDS[:, 1:], return_logprobs=True).logprobs


def _perturb(model, names=None, scale=0.01, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if names is None or n in names:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


# ------------------------------------------------------------------ digests
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4099])
def test_sum64_equals_reference_and_every_digest_sees_one_flipped_byte(n):
    g = torch.Generator().manual_seed(n)
    b = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    b[: min(n, 16)] = 255  # words near 2^64: the sums overflow and must wrap
    assert tensor_digest(b, "sum64") == sum64_reference(b.numpy().tobytes())
    if n:
        flipped = b.clone()
        flipped[n // 2] ^= 0x10
        for algo in T.available_algos():
            assert tensor_digest(flipped, algo) != tensor_digest(b, algo), algo


def test_default_digest_falls_back_to_sha256_without_xxhash(monkeypatch):
    from k3core.transfer import digest

    monkeypatch.setattr(digest, "_xxhash", lambda: None)
    assert digest.default_algo("cpu") == "sha256" and digest.default_algo("cuda") == "sum64"
    with pytest.raises(ValueError, match="xxhash"):
        digest.check_algo("xxh3_128")


def test_digest_covers_bytes_in_memory_order():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    for algo in T.available_algos():
        assert tensor_digest(t.t(), algo) == tensor_digest(t.t().contiguous(), algo)
        assert tensor_digest(t, algo) != tensor_digest(t.t().contiguous(), algo)


# ------------------------------------------------------------------ in-process
def test_inprocess_bit_exact_versioned_and_stale_refused():
    trainer = _model(1)
    eng = engine_from_model(_model(2), 0, quantized=False)
    rep = T.push_inprocess(eng, trainer.state_dict(), 1)
    assert eng.weight_version == 1 and rep.tensors_sent == len(trainer.state_dict())
    assert torch.equal(_logprobs(eng.model), _logprobs(trainer))
    # same bytes -> same content digest, whatever the version
    again = T.push_inprocess(eng, trainer.state_dict(), 2)
    assert again.content_sha256 == rep.content_sha256
    _perturb(trainer)
    with pytest.raises(T.TransferError, match="not newer"):
        T.push_inprocess(eng, trainer.state_dict(), 2)
    bad = dict(trainer.state_dict())
    bad["lm_head.weight"] = bad["lm_head.weight"].double()
    with pytest.raises(T.TransferError, match="float64"):
        T.push_inprocess(eng, bad, 3)
    assert eng.weight_version == 2 and not torch.equal(_logprobs(eng.model), _logprobs(trainer))


@pytest.mark.parametrize("w4a8", [True, False])
def test_inprocess_quantized_equals_engine_state(w4a8):
    trainer = _model(3)
    ref = engine_from_model(_model(4), 0, quantized=w4a8)
    ref.load_weights(engine_state(trainer, quantize_experts=True, w4a8=w4a8), 1)
    eng = engine_from_model(_model(5), 0, quantized=w4a8)
    rep = T.push_inprocess(eng, trainer.state_dict(), 1, quantize_experts=True, w4a8=w4a8, verify=True)
    assert torch.equal(_logprobs(eng.model), _logprobs(ref.model))
    assert rep.bytes_sent < T.wire_nbytes(trainer.state_dict())  # experts moved as MXFP4 bytes
    assert rep.bytes_sent == T.wire_nbytes(trainer.state_dict(), quantize_experts=True)


def test_skipping_the_refresh_leaves_a_stale_attnres_cache():
    """The regression a naive online update hits: the engine caches w * gamma at load."""
    trainer = _model(6)
    eng = engine_from_model(_model(6), 0, quantized=False)
    _perturb(trainer, {n for n, _ in trainer.named_parameters() if n.endswith(("_res_proj.weight", "_res_norm.weight"))},
             scale=0.5)
    T.push_inprocess(eng, trainer.state_dict(), 1, refresh=False)
    stale = _logprobs(eng.model)
    eng.model.refresh_inference_caches()
    fresh = _logprobs(eng.model)
    assert torch.equal(fresh, _logprobs(trainer))
    assert not torch.allclose(stale, fresh, atol=1e-4)


# ------------------------------------------------------------------ disk
def test_disk_bf16_bit_exact_versioned_and_refusals(tmp_path):
    trainer = _model(16, torch.bfloat16)
    rep = T.write_disk(tmp_path / "w", trainer, TINY, version=3, max_shard_bytes=200_000)
    assert rep.buckets > 1 and (tmp_path / "w" / T.VERSION_FILE).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["w"]  # nothing staged left behind
    eng = engine_from_model(_model(17, torch.bfloat16), 0, quantized=False)
    sd, version = T.read_disk(tmp_path / "w", current_version=eng.weight_version)
    eng.load_weights(sd, version)
    assert version == 3 and torch.equal(_logprobs(eng.model), _logprobs(trainer))
    with pytest.raises(T.TransferError, match="not newer"):
        T.read_disk(tmp_path / "w", current_version=3)
    # a second version replaces the first in one step
    _perturb(trainer)
    T.write_disk(tmp_path / "w", trainer, TINY, version=4, max_shard_bytes=200_000)
    assert T.read_version(tmp_path / "w")["weight_version"] == 4
    # one flipped byte in a shard is refused
    shard = sorted((tmp_path / "w").glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x04
    shard.write_bytes(bytes(data))
    with pytest.raises(T.TransferError, match="corrupt bytes"):
        T.read_disk(tmp_path / "w")


def test_disk_mxfp4_to_w4a8_engine_equals_engine_state(tmp_path):
    trainer = _model(18, torch.bfloat16)
    T.write_disk(tmp_path / "mx", trainer, TINY, version=1, quantize_experts=True)
    ref = engine_from_model(_model(19, torch.bfloat16), 0, quantized=True)
    ref.load_weights(engine_state(trainer, quantize_experts=True), 1)
    eng = engine_from_model(_model(19, torch.bfloat16), 0, quantized=True)
    sd, version = T.read_disk(tmp_path / "mx", packed_experts=True)
    eng.load_weights(sd, version)
    assert torch.equal(_logprobs(eng.model), _logprobs(ref.model))
    # float engine, dequantised experts
    ref_f = engine_from_model(_model(19, torch.bfloat16), 0, quantized=False)
    ref_f.load_weights(engine_state(trainer, quantize_experts=True, w4a8=False), 1)
    sd, _ = T.read_disk(tmp_path / "mx")
    eng_f = engine_from_model(_model(19, torch.bfloat16), 0, quantized=False)
    eng_f.load_weights(sd, 1)
    assert torch.equal(_logprobs(eng_f.model), _logprobs(ref_f.model))
    out = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0.0), pad_id=TINY.pad_token_id)
    assert out[0].weight_version == 1


def test_disk_fp32_trainer_arrives_rounded_to_bf16_and_load_disk_fits_the_engine(tmp_path):
    """The public layout is bf16: an fp32 engine gets the trainer's weights rounded to bf16 (the
    fp32-kept tensors exact), the same as loading that rounding in process."""
    from k3core.checkpoint.names import public_dtype

    trainer = _model(21)
    T.write_disk(tmp_path / "w", trainer, TINY, version=2)
    eng = engine_from_model(_model(22), 0, quantized=False)
    assert T.load_disk(eng, tmp_path / "w") == 2 and eng.weight_version == 2
    rounded = {k: v.to(public_dtype(k)).float() for k, v in trainer.state_dict().items()}
    ref = engine_from_model(_model(22), 0, quantized=False)
    ref.load_weights(rounded, 2)
    assert torch.equal(_logprobs(eng.model), _logprobs(ref.model))
    with pytest.raises(T.TransferError, match="not newer"):
        T.load_disk(eng, tmp_path / "w")
    # a W4A8 engine from an MXFP4 checkpoint gets its packed buffers
    T.write_disk(tmp_path / "mx", trainer, TINY, version=3, quantize_experts=True)
    q = engine_from_model(_model(23), 0, quantized=True)
    assert T.load_disk(q, tmp_path / "mx") == 3
    qref = engine_from_model(_model(23), 0, quantized=True)
    qref.load_weights({k: v.to(public_dtype(k)).float() if v.is_floating_point() else v
                       for k, v in engine_state(trainer, quantize_experts=True).items()}, 3)
    assert torch.equal(_logprobs(q.model), _logprobs(qref.model))
