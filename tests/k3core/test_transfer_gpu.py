"""Weight transfer on CUDA: CUDA IPC buckets to an engine in a second process (``sum64`` digests on
the GPU), the shared-memory stream from GPU tensors to a GPU engine, and a flipped byte in a CUDA
bucket refused.

References: the bytes (every tensor of the receiving engine has the digest of the trainer's, or with
MXFP4 experts of an engine loaded with ``stages.engine_state(quantize_experts=True)`` in process), and
logprobs close to that in-process engine's on the same GPU (not asserted bit-equal across processes:
Triton autotuning may pick different kernel configurations in each). Run:
``pytest -m gpu tests/k3core/test_transfer_gpu.py``.
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
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY = K3Config.preset("tiny")


def _model(seed: int) -> K3ForCausalLM:
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return m.cuda()


IDS = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(7))


def _logprobs(model) -> torch.Tensor:
    ids = IDS.cuda()
    with torch.no_grad():
        return model(ids[:, :-1], targets=ids[:, 1:], return_logprobs=True).logprobs.float().cpu()


DEVICE = "cuda"
_spec = importlib.util.spec_from_file_location("transfer_engine_worker", Path(__file__).with_name("transfer_engine_worker.py"))
_worker_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker_module)


@pytest.fixture(scope="module")
def worker():
    w = _worker_module.Worker(DEVICE)
    yield w
    w.close()


def test_cuda_ipc_bit_exact_then_a_corrupt_bucket_is_refused(worker):
    trainer = _model(1)
    sd = trainer.state_dict()
    with T.send_cuda_ipc(sd, 1, bucket_bytes=128 << 10) as sent:
        assert sent.payload["transport"] == "cuda_ipc" and sent.payload["hash"] == "sum64"
        r = worker(op="load", engine="float", payload=json.loads(json.dumps(sent.payload)))
        assert r == {"ok": True, "version": 1}, r
    got = worker(op="digests", engine="float", algo="sum64")["digests"]
    assert got == {k: T.tensor_digest(v, "sum64") for k, v in sd.items()}
    local = engine_from_model(_model(2), 0, quantized=False)
    T.push_inprocess(local, sd, 1)
    want = _logprobs(local.model)
    torch.testing.assert_close(worker.logprobs("float", IDS), want, rtol=0, atol=1e-5)

    new = _model(3)
    with T.send_cuda_ipc(new.state_dict(), 2, bucket_bytes=128 << 10) as sent:
        e = sent.payload["buckets"][1]["tensors"][0]
        buf = sent._buffers[1]
        i = e["offset"] + e["nbytes"] // 2
        buf[i] = buf[i] ^ 1
        torch.cuda.synchronize()
        r = worker(op="load", engine="float", payload=sent.payload)
    assert not r["ok"] and "corrupt bucket" in r["error"] and r["version"] == 1
    assert worker(op="digests", engine="float", algo="sum64")["digests"] == got
    torch.testing.assert_close(worker.logprobs("float", IDS), want, rtol=0, atol=1e-5)


def test_cuda_ipc_mxfp4_experts_equal_engine_state(worker):
    trainer = _model(4)
    ref = engine_from_model(_model(5), 0, quantized=True)
    ref.load_weights(engine_state(trainer, quantize_experts=True), 1)
    with T.send_cuda_ipc(trainer.state_dict(), 1, quantize_experts=True) as sent:
        r = worker(op="load", engine="w4a8", payload=sent.payload)
        assert r["ok"], r
    assert sent.report.bytes_sent == T.wire_nbytes(trainer.state_dict(), quantize_experts=True)
    got = worker(op="digests", engine="w4a8", algo="sum64")["digests"]
    assert got == {k: T.tensor_digest(v, "sum64") for k, v in T.engine_tensors(ref).items()}
    torch.testing.assert_close(worker.logprobs("w4a8", IDS), _logprobs(ref.model), rtol=0, atol=1e-5)


def test_stream_from_gpu_tensors_to_a_gpu_engine(worker):
    trainer = _model(6)
    with T.send_shm_stream(trainer.state_dict(), 10, ring=2, bucket_bytes=64 << 10) as sent:
        r = worker(op="load", engine="float", payload=sent.payload)
        assert r["ok"], r
        assert sent.wait(60).buckets > 2  # the ring went round
    got = worker(op="digests", engine="float", algo="sum64")["digests"]
    assert got == {k: T.tensor_digest(v, "sum64") for k, v in trainer.state_dict().items()}
    assert not [n for n in T.live_segments() if n.startswith(f"{T.SHM_PREFIX}{os.getpid()}-")]
