"""Weight transfer (k3core.transfer) over its three paths on the tiny preset, fp32.

The reference for every path: the trainer itself (engine logprobs bit-equal to the trainer's on a
fixed batch) or, with MXFP4 experts, an engine loaded with ``stages.engine_state(quantize_experts=True)``
in process. The shared-memory path runs against an engine in a real second process
(``transfer_engine_worker.py``). Refusals (corrupt bucket, wrong shape, stale version, missing
segment, delta against other weights) must leave the old version answering.
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from k3core import transfer as T
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.weights import engine_from_model, engine_state
from k3core.rollout.engine import SamplingParams
from k3core.transfer.digest import sum64_reference, tensor_digest

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


def _my_segments() -> list[str]:
    return [n for n in T.live_segments() if n.startswith(f"{T.SHM_PREFIX}{os.getpid()}-")]


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
    assert eng.weight_version == 1 and rep.tensors_sent == rep.tensors_total == len(trainer.state_dict())
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


def test_inprocess_delta_moves_only_changed_bytes_and_ends_identical():
    trainer = _model(7)
    eng = engine_from_model(_model(8), 0, quantized=False)
    tracker = T.DeltaTracker()
    full = T.push_inprocess(eng, trainer.state_dict(), 1, tracker=tracker)
    changed = {"lm_head.weight", "model.layers.1.self_attn.q_proj.weight"}
    changed = {n for n, _ in trainer.named_parameters() if n in changed or n.endswith("layers.2.mlp_res_proj.weight")}
    assert len(changed) == 3
    _perturb(trainer, changed)
    delta = T.push_inprocess(eng, trainer.state_dict(), 2, tracker=tracker, verify=True)
    sd = trainer.state_dict()
    assert delta.base_version == 1 and delta.tensors_sent == 3
    assert delta.bytes_sent == sum(sd[n].numel() * 4 for n in changed) < full.bytes_sent / 10
    assert torch.equal(_logprobs(eng.model), _logprobs(trainer))
    # the engine's copy no longer matches the tracker's record: verify refuses the delta
    with torch.no_grad():
        eng.model.model.norm.weight.add_(1.0)
    _perturb(trainer, {"lm_head.weight"}, seed=1)
    with pytest.raises(T.TransferError, match="delta refused"):
        T.push_inprocess(eng, trainer.state_dict(), 3, tracker=tracker, verify=True)
    assert eng.weight_version == 2


# ------------------------------------------------------------------ shared memory, same process
@pytest.mark.parametrize("algo", T.available_algos())
def test_shm_payload_round_trip_bucketed_and_unlinked(algo):
    trainer = _model(9)
    with T.send_shm(trainer.state_dict(), 5, bucket_bytes=64 << 10, algo=algo) as sent:
        payload = json.loads(json.dumps(sent.payload))  # JSON-serialisable
        assert sent.report.buckets == len(payload["buckets"]) > 5
        assert all(b["nbytes"] <= 64 << 10 or len(b["tensors"]) == 1 for b in payload["buckets"])
        assert set(sent.segment_names) == set(_my_segments())
        sd, version = T.receive(payload, current_version=4, expected=trainer.state_dict())
    assert version == 5 and not _my_segments()
    for k, v in trainer.state_dict().items():
        assert torch.equal(sd[k], v), k  # views stay valid after the sender unlinked


def test_shm_pool_reuses_segments_and_unlinks_on_close():
    trainer = _model(20)
    with T.ShmPool(segment_bytes=256 << 10) as pool:
        names = None
        for version in (1, 2, 3):
            _perturb(trainer, seed=version)
            sent = T.send_shm(trainer.state_dict(), version, bucket_bytes=256 << 10, pool=pool)
            sd, got = T.receive(sent.payload)
            assert got == version and all(torch.equal(sd[k], v) for k, v in trainer.state_dict().items())
            del sd
            sent.acknowledge()
            assert names is None or pool.segment_names == names  # the same segments, refilled
            names = pool.segment_names
        assert set(_my_segments()) == set(names)
        # a byte flipped in a refilled segment is caught through the receiver's cached mapping too
        sent = T.send_shm(trainer.state_dict(), 4, bucket_bytes=256 << 10, pool=pool)
        e = sent.payload["buckets"][0]["tensors"][-1]
        sent._buffers[0][e["offset"]] ^= 0x80
        with pytest.raises(T.TransferError, match="corrupt bucket"):
            T.receive(sent.payload)
        sent.close()
    T.forget_mappings()
    assert not _my_segments()


def test_receive_refuses_bad_payloads():
    trainer = _model(10)
    sd = trainer.state_dict()
    with T.send_shm(sd, 3, bucket_bytes=32 << 10) as sent:
        p = sent.payload
        with pytest.raises(T.TransferError, match="not newer"):
            T.receive(p, current_version=3)
        bad = json.loads(json.dumps(p))
        bad["buckets"][0]["shm"] = "../../etc/passwd"
        with pytest.raises(T.TransferError, match="not a k3xfer"):
            T.receive(bad)
        bad = json.loads(json.dumps(p))
        bad["buckets"][1]["tensors"][0]["shape"][0] += 1  # entry list no longer matches its digest
        with pytest.raises(T.TransferError, match="digest"):
            T.receive(bad)
        wrong = dict(sd)
        wrong["lm_head.weight"] = torch.zeros(3, 3)
        with pytest.raises(T.TransferError, match="missing"):
            T.receive(p, expected={k: v for k, v in sd.items() if k != "lm_head.weight"} | {"x": torch.zeros(1)})
    with pytest.raises(T.TransferError, match="is missing"):  # closed before the receiver loaded it
        T.receive(p)
    with T.send_shm(wrong, 4) as sent:
        with pytest.raises(T.TransferError, match="shape"):
            T.receive(sent.payload, expected=sd)
    assert not _my_segments()


# ------------------------------------------------------------------ shared memory, another process
DEVICE = "cpu"
_spec = importlib.util.spec_from_file_location("transfer_engine_worker", Path(__file__).with_name("transfer_engine_worker.py"))
_worker_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker_module)


@pytest.fixture(scope="module")
def worker():
    w = _worker_module.Worker(DEVICE)
    yield w
    w.close()


def _send_and_load(worker, engine, sd, version, **kw):
    with T.send_shm(sd, version, bucket_bytes=128 << 10, **kw) as sent:
        r = worker(op="load", engine=engine, payload=sent.payload)
        if r["ok"]:
            sent.acknowledge()
    return r, sent


def test_shm_to_another_process_bit_exact_then_refusals_keep_the_old_version(worker):
    trainer = _model(11)
    r, sent = _send_and_load(worker, "float", trainer.state_dict(), 1)
    assert r == {"ok": True, "version": 1} and sent.report.bytes_sent == T.wire_nbytes(trainer.state_dict())
    want = _logprobs(trainer)
    assert torch.equal(worker.logprobs("float", IDS), want)
    assert not _my_segments()

    new = _model(12)
    # a corrupt bucket: one byte flipped in shared memory after the sender hashed it
    with T.send_shm(new.state_dict(), 2, bucket_bytes=128 << 10) as sent:
        seg = sent.segment_names[1]
        e = sent.payload["buckets"][1]["tensors"][0]
        with open(f"/dev/shm/{seg}", "r+b") as f:
            f.seek(e["offset"] + e["nbytes"] // 2)
            b = f.read(1)
            f.seek(e["offset"] + e["nbytes"] // 2)
            f.write(bytes([b[0] ^ 0x01]))
        r = worker(op="load", engine="float", payload=sent.payload)
    assert not r["ok"] and "corrupt bucket" in r["error"] and r["version"] == 1
    # a wrong shape, consistently described (digests fine): the engine's own shapes refuse it
    wrong = dict(new.state_dict())
    wrong["lm_head.weight"] = wrong["lm_head.weight"][:-1]
    r, _ = _send_and_load(worker, "float", wrong, 2)
    assert not r["ok"] and "shape" in r["error"] and r["version"] == 1
    # a stale version
    r, _ = _send_and_load(worker, "float", new.state_dict(), 1)
    assert not r["ok"] and "not newer" in r["error"]
    # the old version keeps answering
    assert torch.equal(worker.logprobs("float", IDS), want)
    g = worker(op="generate", engine="float")
    assert g["version"] == 1 and g["versions"] == [1, 1] and all(1 <= n <= 3 for n in g["lengths"])
    assert not _my_segments()


def test_shm_quantized_experts_to_another_process_equal_engine_state(worker):
    trainer = _model(13)
    ref = engine_from_model(_model(14), 0, quantized=True)
    ref.load_weights(engine_state(trainer, quantize_experts=True), 1)
    r, sent = _send_and_load(worker, "w4a8", trainer.state_dict(), 1, quantize_experts=True)
    assert r["ok"], r
    assert sent.report.bytes_sent == T.wire_nbytes(trainer.state_dict(), quantize_experts=True)
    assert torch.equal(worker.logprobs("w4a8", IDS), _logprobs(ref.model))
    # float engine running MXFP4 weights: packed bytes travel, dequantised on receive
    ref_f = engine_from_model(_model(14), 0, quantized=False)
    ref_f.load_weights(engine_state(trainer, quantize_experts=True, w4a8=False), 1)
    r, sent = _send_and_load(worker, "float", trainer.state_dict(), 50, quantize_experts=True, w4a8=False)
    assert r["ok"], r
    assert sent.report.bytes_sent == T.wire_nbytes(trainer.state_dict(), quantize_experts=True)
    assert torch.equal(worker.logprobs("float", IDS), _logprobs(ref_f.model))


def test_shm_delta_to_another_process_moves_only_changed_bytes(worker):
    trainer = _model(15)
    tracker = T.DeltaTracker()
    r, full = _send_and_load(worker, "float", trainer.state_dict(), 100, tracker=tracker)
    assert r["ok"] and tracker.version == 100
    changed = {"model.embed_tokens.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"}
    changed = {n for n, _ in trainer.named_parameters() if n in changed}
    assert len(changed) == 2
    _perturb(trainer, changed)
    r, delta = _send_and_load(worker, "float", trainer.state_dict(), 101, tracker=tracker)
    sd = trainer.state_dict()
    assert r["ok"] and delta.report.tensors_sent == 2 and delta.payload["base_version"] == 100
    assert delta.report.bytes_sent == sum(sd[n].numel() * 4 for n in changed)
    assert torch.equal(worker.logprobs("float", IDS), _logprobs(trainer))
    digests = worker(op="digests", engine="float", algo="sha256")["digests"]
    assert digests == {k: tensor_digest(v, "sha256") for k, v in sd.items()}
    # a delta computed against a version the receiver does not hold is refused
    stale_tracker = T.DeltaTracker()
    stale_tracker.commit(100, tracker.digests, tracker.algo)
    _perturb(trainer, {"lm_head.weight"})
    r, _ = _send_and_load(worker, "float", trainer.state_dict(), 102, tracker=stale_tracker)
    assert not r["ok"] and "holds 101" in r["error"] and r["version"] == 101
    assert not _my_segments()


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
