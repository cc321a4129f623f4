"""The cross-process transfer on one host (k3core.transfer.stream, the shared-memory ring) on the
tiny preset, fp32.

References as in test_transfer.py: the trainer's own logprobs (bit-exact), an engine loaded in
process with ``stages.engine_state`` for MXFP4 experts, and the in-process path's report for the
content digest. The receiver is a real engine in a second process (``transfer_engine_worker.py``);
senders that die or stall run in a third. Refusals (corrupt bucket, wrong shape, stale version,
malformed payload, a sender gone) must leave the old version answering and no segment behind.
Shared memory is measured two ways: every segment the transport creates, and what /dev/shm holds
while a state ~9x the ring streams through it (and, to show the sampler sees a large ring, while
the same state goes through a ring as large as itself).
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from k3core import transfer as T
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.weights import engine_from_model, engine_state
from k3core.transfer import segments as segments_module
from k3core.transfer import stream as stream_module

TINY = K3Config.preset("tiny")
IDS = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(7))
BUCKET = 64 << 10  # below the tiny preset's largest tensor (128 KiB): tensors split across buckets
RING = 2

_spec = importlib.util.spec_from_file_location("transfer_engine_worker", Path(__file__).with_name("transfer_engine_worker.py"))
_worker_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker_module)


def _model(seed: int) -> K3ForCausalLM:
    m = K3ForCausalLM(TINY)
    m.reset_parameters(seed)
    with torch.no_grad():  # AttnRes projections start at zero: make them matter
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return m


def _logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[:, :-1], targets=IDS[:, 1:], return_logprobs=True).logprobs


def _nbytes(sd) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def _my_segments() -> list[str]:
    return [n for n in T.live_segments() if n.startswith(f"{T.SHM_PREFIX}{os.getpid()}-")]


def _segment_bytes(pid: int) -> int:
    total = 0
    for n in T.live_segments(f"{T.SHM_PREFIX}{pid}-"):
        try:
            total += os.stat(os.path.join(segments_module.SHM_DIR, n)).st_size
        except FileNotFoundError:
            pass
    return total


@pytest.fixture(scope="module")
def worker():
    w = _worker_module.Worker("cpu")
    yield w
    w.close()


def _stream_and_load(worker, engine, sd, version, **kw):
    """Stream ``sd`` to the worker's engine; return (worker reply, sender's outcome)."""
    kw = {"ring": RING, "bucket_bytes": BUCKET, **kw}
    with T.send_shm_stream(sd, version, **kw) as sent:
        r = worker(op="load", engine=engine, payload=json.loads(json.dumps(sent.payload)))
        try:
            outcome = sent.wait(60)
        except T.TransferError as e:
            outcome = e
    return r, outcome


def _version(worker, engine) -> int:
    return worker(op="generate", engine=engine)["version"]


# ------------------------------------------------------------------ same process
@pytest.mark.parametrize("algo", T.available_algos())
def test_stream_round_trip_splits_large_tensors_and_names_the_same_content(algo):
    trainer = _model(1)
    sd = trainer.state_dict()
    assert max(v.numel() * v.element_size() for v in sd.values()) > BUCKET
    sent = T.send_shm_stream(sd, 5, ring=RING, bucket_bytes=BUCKET, algo=algo)
    assert len(sent.segment_names) == RING and set(sent.segment_names) == set(_my_segments())
    got, version = T.receive(sent.payload, current_version=4, expected=sd)
    rep = sent.wait(60)
    assert version == 5 and rep.buckets > _nbytes(sd) // BUCKET and rep.bytes_sent == T.wire_nbytes(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v) and got[k].data_ptr() != v.data_ptr(), k
    inprocess = T.push_inprocess(engine_from_model(_model(11), 0, quantized=False), sd, 1, algo=algo)
    assert rep.content_sha256 == inprocess.content_sha256  # names the weights, whatever the path
    assert not _my_segments()


def test_stream_kept_staging_is_reused_and_each_ring_unlinked():
    trainer = _model(10)
    staging: dict = {}
    ptrs, rings = None, []
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.01 * version)
        sd = trainer.state_dict()
        sent = T.send_shm_stream(sd, version, ring=RING, bucket_bytes=BUCKET)
        rings.append(set(sent.segment_names))
        got, v = T.receive(sent.payload, staging=staging)
        sent.wait(60)
        assert v == version and all(torch.equal(got[k], t) for k, t in sd.items())
        assert ptrs is None or {k: t.data_ptr() for k, t in got.items()} == ptrs  # the same staged tensors
        ptrs = {k: t.data_ptr() for k, t in got.items()}
        assert not _my_segments()
    assert len(rings) == 3 and not rings[0] & rings[1]  # a fresh ring per stream, gone after it


def test_stream_refuses_malformed_payloads_and_tells_the_sender():
    sd = _model(12).state_dict()
    with pytest.raises(T.TransferError, match="transport 'shm'"):
        T.receive({"format": "k3rl.weights/1", "transport": "shm", "weight_version": 1})
    sent = T.send_shm_stream(sd, 3, ring=RING, bucket_bytes=BUCKET)
    bad = json.loads(json.dumps(sent.payload))
    bad["ring"][0] = "../../etc/passwd"
    with pytest.raises(T.TransferError, match="k3xfer-\\* segment names"):
        T.receive(bad)
    with pytest.raises(T.TransferError, match="receiver refused.*k3xfer"):
        sent.wait(60)
    assert not _my_segments()
    # the receiver holds other names: refused at the first tensor it does not have
    sent = T.send_shm_stream(sd, 4, ring=RING, bucket_bytes=BUCKET)
    first = next(iter(sd))
    with pytest.raises(T.TransferError, match=f"{first}: not a tensor of the receiver"):
        T.receive(sent.payload, expected={k: v for k, v in sd.items() if k != first})
    with pytest.raises(T.TransferError, match="not a tensor of the receiver"):
        sent.wait(60)
    assert not _my_segments()


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_a_segment_name_planted_in_dev_shm_reads_no_other_file(tmp_path, planted):
    """A payload naming a k3xfer-* entry that is a link to another file (or not a file) is refused
    before a byte is read: the refusal must not become an oracle of that file's contents."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root-only bytes" * 4096)
    sd = _model(12).state_dict()
    sent = T.send_shm_stream(sd, 3, ring=RING, bucket_bytes=BUCKET)
    bad = json.loads(json.dumps(sent.payload))
    name = f"{T.SHM_PREFIX}{os.getpid()}-planted-{planted}"
    path = Path(segments_module.SHM_DIR, name)
    os.symlink(secret, path) if planted == "symlink" else os.mkfifo(path)
    try:
        bad["ring"][0] = name
        with pytest.raises(T.TransferError, match="symbolic link" if planted == "symlink" else "not a shared-memory file"):
            T.receive(bad)
        with pytest.raises(T.TransferError, match="receiver refused"):
            sent.wait(60)
    finally:
        path.unlink()
    assert not _my_segments()


def test_a_digest_refusal_names_only_the_senders_digest():
    from k3core.transfer.verify import check_digest

    part = torch.arange(64, dtype=torch.uint8)
    got = T.tensor_digest(part, "sha256")
    with pytest.raises(T.TransferError, match="does not match") as e:
        check_digest(part, "0" * 64, "sha256", "bucket 0")
    assert got not in str(e.value) and "0" * 64 in str(e.value)


def test_stream_refuses_a_stale_version_and_tells_the_sender():
    sd = _model(2).state_dict()
    sent = T.send_shm_stream(sd, 3, ring=RING, bucket_bytes=BUCKET)
    with pytest.raises(T.TransferError, match="not newer"):
        T.receive(sent.payload, current_version=3)
    with pytest.raises(T.TransferError, match="receiver refused.*not newer"):
        sent.wait(60)
    assert not _my_segments()
    # nobody connects: the sender gives up after its timeout, with the ring unlinked
    sent = T.send_shm_stream(sd, 4, ring=RING, bucket_bytes=BUCKET, timeout=0.5)
    with pytest.raises(T.TransferError, match="no receiver connected"):
        sent.wait(30)
    assert not _my_segments()
    # and a payload whose stream already ran cannot be received again
    with pytest.raises(T.TransferError, match="cannot reach the sender"):
        T.receive(sent.payload)


# ------------------------------------------------------------------ another process
def test_stream_peak_shared_memory_is_the_ring_not_the_model(worker, monkeypatch):
    trainer = _model(3)
    sd = trainer.state_dict()
    ring_bytes = RING * BUCKET
    assert _nbytes(sd) > 8 * ring_bytes
    created = []
    real_create = segments_module.create_segment

    def counting_create(name, nbytes):
        created.append(nbytes)
        return real_create(name, nbytes)

    monkeypatch.setattr(segments_module, "create_segment", counting_create)
    monkeypatch.setattr(stream_module, "create_segment", counting_create)

    def peak_while(run) -> int:
        """Most bytes this process's segments held in /dev/shm, sampled while ``run()`` runs."""
        peak, stop = [0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _segment_bytes(os.getpid()))
                time.sleep(0.0005)

        t = threading.Thread(target=sample)
        t.start()
        try:
            run()
        finally:
            stop.set()
            t.join()
        return peak[0]

    version = _version(worker, "float") + 1
    out = {}
    peak = peak_while(lambda: out.update(zip(("r", "outcome"), _stream_and_load(worker, "float", sd, version))))
    assert out["r"] == {"ok": True, "version": version}, out
    assert out["outcome"].buckets > 8 and out["outcome"].extra["peak_shm_bytes"] == ring_bytes
    assert sum(created) == ring_bytes and 0 < peak <= ring_bytes
    assert torch.equal(worker.logprobs("float", IDS), _logprobs(trainer))
    # the same measurement sees a ring as large as the state: it would see a model-sized /dev/shm
    created.clear()
    whole = _nbytes(sd) + (1 << 20)  # room for the alignment of every tensor
    out.clear()
    peak = peak_while(lambda: out.update(zip(("r", "outcome"), _stream_and_load(worker, "float", sd, version + 1,
                                                                               ring=1, bucket_bytes=whole))))
    assert out["r"] == {"ok": True, "version": version + 1}, out
    assert sum(created) >= whole and peak >= _nbytes(sd)
    assert not _my_segments()


def test_stream_quantized_experts_to_another_process(worker):
    trainer = _model(4)
    # W4A8 engine: packed MXFP4 experts into its own buffers
    ref = engine_from_model(_model(5), 0, quantized=True)
    ref.load_weights(engine_state(trainer, quantize_experts=True), 1)
    v = _version(worker, "w4a8") + 1
    r, rep = _stream_and_load(worker, "w4a8", trainer.state_dict(), v, quantize_experts=True)
    assert r["ok"], r
    assert rep.bytes_sent == T.wire_nbytes(trainer.state_dict(), quantize_experts=True)
    assert torch.equal(worker.logprobs("w4a8", IDS), _logprobs(ref.model))
    # float engine running MXFP4 weights: codes travel, dequantised by the receiver
    ref_f = engine_from_model(_model(5), 0, quantized=False)
    ref_f.load_weights(engine_state(trainer, quantize_experts=True, w4a8=False), 1)
    v = _version(worker, "float") + 1
    r, rep = _stream_and_load(worker, "float", trainer.state_dict(), v, quantize_experts=True, w4a8=False)
    assert r["ok"], r
    assert torch.equal(worker.logprobs("float", IDS), _logprobs(ref_f.model))
    assert not _my_segments()


def _load_old_version(worker, seed: int) -> tuple[int, torch.Tensor]:
    trainer = _model(seed)
    v = _version(worker, "float") + 1
    r, _ = _stream_and_load(worker, "float", trainer.state_dict(), v)
    assert r["ok"], r
    want = _logprobs(trainer)
    assert torch.equal(worker.logprobs("float", IDS), want)
    return v, want


def _still_serving(worker, v: int, want: torch.Tensor) -> None:
    assert torch.equal(worker.logprobs("float", IDS), want)
    g = worker(op="generate", engine="float")
    assert g["version"] == v and g["versions"] == [v, v] and all(1 <= n <= 3 for n in g["lengths"])


def test_stream_corrupt_byte_in_a_middle_bucket_is_refused(worker, monkeypatch):
    v, want = _load_old_version(worker, 6)
    new = _model(7).state_dict()
    calls = []
    real_fill = stream_module._fill

    def counting_fill(dst, src):
        calls.append(dst.numel())
        real_fill(dst, src)

    monkeypatch.setattr(stream_module, "_fill", counting_fill)
    with T.send_shm_stream(new, v + 1, ring=RING, bucket_bytes=BUCKET) as sent:  # a clean run: count the chunks
        T.receive(sent.payload)
        n_buckets = sent.wait(60).buckets
    middle, corrupted = len(calls) // 2, []

    def corrupting_fill(dst, src):  # one byte flipped in shared memory after the sender copied it
        real_fill(dst, src)
        corrupted.append(len(corrupted))
        if len(corrupted) - 1 == middle:
            dst[dst.numel() // 2] ^= 0x01

    monkeypatch.setattr(stream_module, "_fill", corrupting_fill)
    r, outcome = _stream_and_load(worker, "float", new, v + 1)
    assert n_buckets > 8 and not r["ok"] and "corrupt bucket" in r["error"] and r["version"] == v
    assert isinstance(outcome, T.TransferError) and "corrupt bucket" in str(outcome)
    _still_serving(worker, v, want)
    # a wrong shape is refused as soon as the item is declared
    monkeypatch.setattr(stream_module, "_fill", real_fill)
    wrong = dict(new)
    wrong["lm_head.weight"] = wrong["lm_head.weight"][:-1]
    r, outcome = _stream_and_load(worker, "float", wrong, v + 1)
    assert not r["ok"] and "shape" in r["error"] and isinstance(outcome, T.TransferError)
    _still_serving(worker, v, want)
    # and a version not newer than the served one
    r, outcome = _stream_and_load(worker, "float", new, v)
    assert not r["ok"] and "not newer" in r["error"] and "not newer" in str(outcome)
    _still_serving(worker, v, want)
    assert not _my_segments()


SENDER = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    from k3core import transfer as T
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM

    version, die_at, sig, timeout = int(sys.argv[1]), int(sys.argv[2]), getattr(signal, sys.argv[3]), float(sys.argv[4])
    m = K3ForCausalLM(K3Config.preset("tiny"))
    m.reset_parameters(9)

    class DiesMidStream(dict):
        def items(self):
            for i, kv in enumerate(super().items()):
                if i == die_at:
                    os.kill(os.getpid(), sig)
                yield kv

    sent = T.send_shm_stream(DiesMidStream(m.state_dict()), version, ring=2, bucket_bytes=64 << 10, timeout=timeout)
    print(json.dumps(sent.payload), flush=True)
    sent.wait()
""")


@pytest.mark.parametrize("sig, expect", [("SIGKILL", "sender closed the control connection"),
                                          ("SIGSTOP", "no word from the sender for 2 s")])
def test_stream_sender_dies_or_stalls_mid_stream_and_the_old_version_keeps_serving(worker, sig, expect):
    v, want = _load_old_version(worker, 8)
    n = len(_model(9).state_dict())
    proc = subprocess.Popen([sys.executable, "-c", SENDER, str(v + 1), str(n // 2), sig, "2"], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        payload = json.loads(proc.stdout.readline())
        t0 = time.monotonic()
        r = worker(op="load", engine="float", payload=payload)
        assert not r["ok"] and expect in r["error"] and r["version"] == v, r
        assert time.monotonic() - t0 < 30
    finally:
        proc.kill()
        proc.wait(30)
    _still_serving(worker, v, want)
    # the dead sender's ring goes with it (Python's resource tracker unlinks it)
    deadline = time.monotonic() + 30
    while T.live_segments(f"{T.SHM_PREFIX}{proc.pid}-") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not T.live_segments(f"{T.SHM_PREFIX}{proc.pid}-")


def test_stream_through_the_server_update_weights_from_tensor(tmp_path):
    """The HTTP server as a real subprocess takes a streamed payload on /update_weights_from_tensor."""
    from k3core.checkpoint.hf import init_checkpoint, load_model
    from k3core.rollout.engine import SamplingParams
    from flows.cli_serve import launch
    from k3core.rollout.checkpoints import engine_from_checkpoint

    init_checkpoint("tiny", tmp_path / "a", seed=0)
    init_checkpoint("tiny", tmp_path / "b", seed=1)
    proc, client = launch(tmp_path / "a", "--max-batch", "4", log_path=tmp_path / "server.log",
                          env={"OMP_NUM_THREADS": "1"}, timeout=60, retries=0)
    try:
        greedy = SamplingParams(max_new_tokens=4, temperature=0)
        prompts = [[256, 72, 105], [256, 1, 2, 3]]
        want = [c.output_ids for c in engine_from_checkpoint(tmp_path / "b").generate(prompts, greedy)]
        v = client.weight_version()
        state = load_model(tmp_path / "b", dtype=torch.float32).state_dict()
        with T.send_shm_stream(state, v + 1, ring=RING, bucket_bytes=BUCKET) as sent:
            ans = client.update_weights_from_tensor(sent.payload)
            rep = sent.wait(60)
        assert ans["success"] and ans["weight_version"] == v + 1 and rep.buckets > RING
        assert [c.output_ids for c in client.generate(prompts, greedy, expected_version=v + 1)] == want
    finally:
        proc.terminate()
        proc.wait(20)
