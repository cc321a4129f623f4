"""The HTTP server as a real subprocess on 127.0.0.1 (tiny preset checkpoints from init_checkpoint),
driven through the client: /generate equals the in-process engine for the same seed; concurrent
/generate calls during /update_weights_from_disk all succeed, each with a consistent weight version;
bad updates are refused while the old version keeps answering; transfer payloads load through
/update_weights_from_tensor; overload answers 503; a dead server gives clear client errors."""

import base64
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from flows.cli_serve import launch
from k3core.checkpoint.hf import init_checkpoint, load_model
from k3core.config import K3Config
from k3core.rollout.checkpoints import engine_from_checkpoint
from k3core.rollout.client import (RequestRefused, RolloutClient, ServerOverloaded, ServerUnavailable,
                                   WeightUpdateRefused, WeightVersionMismatch)
from k3core.rollout.engine import SamplingParams

TINY = K3Config.preset("tiny")
PROMPTS = [[256, 72, 105], [256, 1, 2, 3, 4, 5, 6, 7], [256, 9]]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    ckpts = {name: root / name for name in ("a", "b", "other")}
    init_checkpoint("tiny", ckpts["a"], seed=0)
    init_checkpoint("tiny", ckpts["b"], seed=1)
    init_checkpoint(TINY.replace(hidden_size=128), ckpts["other"], seed=0)  # another architecture
    proc, client = launch(ckpts["a"], "--max-batch", "8", "--max-queue", "64", log_path=root / "server.log",
                          env={"OMP_NUM_THREADS": "1"}, timeout=60, retries=2, backoff=0.05)
    port = int(client.url.rsplit(":", 1)[1])
    local = {k: RolloutClient("local", engine=engine_from_checkpoint(ckpts[k])) for k in ("a", "b")}
    yield {"client": client, "ckpts": ckpts, "local": local, "port": port}
    proc.terminate()
    proc.wait(20)


def _post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _outputs(comps):
    return [c.output_ids for c in comps]


def test_generate_equals_the_in_process_engine(server):
    client, local = server["client"], server["local"]["a"]
    if client.weight_version() != 0:
        pytest.skip("runs first, on the initial weights")
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.9, n=2, seed=11, stop_token_ids=(257,))
    remote, want = client.generate(PROMPTS, sp, expected_version=0), local.generate(PROMPTS, sp)
    assert _outputs(remote) == _outputs(want)
    assert [(c.prompt_index, c.sample_index) for c in remote] == [(c.prompt_index, c.sample_index) for c in want]
    for r, w in zip(remote, want):
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
        assert torch.equal(r.routing, w.routing) and r.weight_version == 0 and r.finish_reason == w.finish_reason
    # the raw SGLang-style answer: one prompt, n=1 -> one object
    out = _post(server["port"], "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3, "seed": 5},
                                              "return_logprob": True})
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == meta["completion_tokens"]
    assert meta["prompt_tokens"] == 3 and meta["weight_version"] == 0  # bos + 2 bytes
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["finish_reason"] in ({"type": "length", "length": 3}, {"type": "stop", "matched": 257})
    # batch + n: a list ordered (prompt, sample); routed experts as base64 int32
    outs = _post(server["port"], "/generate", {"input_ids": PROMPTS[:2], "return_routed_experts": True,
                                               "sampling_params": {"max_new_tokens": 2, "n": 2, "temperature": 0}})
    assert len(outs) == 4 and outs[0]["output_ids"] == outs[1]["output_ids"]
    r = torch.frombuffer(bytearray(base64.b64decode(outs[2]["meta_info"]["routed_experts"])), dtype=torch.int32)
    assert r.numel() == (len(PROMPTS[1]) + 2 - 1) * len(TINY.moe_layers) * TINY.num_experts_per_token


def test_stop_strings_end_the_text(server):
    port = server["port"]
    free = _post(port, "/generate", {"text": "ab", "sampling_params": {"max_new_tokens": 8, "seed": 3, "ignore_eos": True}})
    text = free["text"]
    stop = next(ch for ch in text[2:] if ch.isprintable() and ch != "\ufffd") if len(text) > 2 else None
    if stop is None:
        pytest.skip("sampled text has no usable stop character")
    got = _post(port, "/generate", {"text": "ab", "sampling_params": {"max_new_tokens": 8, "seed": 3, "stop": [stop],
                                                                       "ignore_eos": True}})
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert got["text"] == text[:text.find(stop)] and stop not in got["text"]
    assert free["output_ids"][:len(got["output_ids"])] == got["output_ids"]


def test_concurrent_generate_during_update_from_disk(server):
    """Three threads keep calling /generate while the main thread swaps a -> b -> a: every call
    succeeds and its tokens are exactly the greedy output of the version it reports."""
    client, ckpts = server["client"], server["ckpts"]
    v0 = client.weight_version()
    want = {k: _outputs(server["local"][k].generate(PROMPTS, GREEDY)) for k in ("a", "b")}
    which = {v0: "a", v0 + 1: "b", v0 + 2: "a"}
    results, errors, stop = [], [], threading.Event()

    def worker(k):
        while not stop.is_set():
            try:
                i = len(results) % len(PROMPTS)
                comp = client.generate([PROMPTS[i]], GREEDY)[0]
                results.append((k, i, comp))
            except Exception as e:  # reported below
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    while len(results) < 3 and not errors:
        time.sleep(0.01)
    for v, k in ((v0 + 1, "b"), (v0 + 2, "a")):
        ans = client.update_weights_from_disk(str(ckpts[k]), v)
        assert ans["success"] and ans["weight_version"] == v
        n = len(results)
        while len(results) < n + 3 and not errors:
            time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    seen = {c.weight_version for _, _, c in results}
    assert {v0, v0 + 1, v0 + 2} <= seen
    for _, i, c in results:
        assert c.output_ids == want[which[c.weight_version]][i], (i, c.weight_version)
    assert client.weight_version() == v0 + 2


def test_bad_updates_are_refused_and_the_old_version_keeps_answering(server):
    client, ckpts = server["client"], server["ckpts"]
    v = client.weight_version()
    before = _outputs(client.generate(PROMPTS, GREEDY, expected_version=v))
    for path, msg in ((ckpts["other"], "another architecture"), (ckpts["a"] / "missing", "config.json")):
        with pytest.raises(WeightUpdateRefused, match=msg):
            client.update_weights_from_disk(str(path), v + 1)
        assert client.weight_version() == v
        assert _outputs(client.generate(PROMPTS, GREEDY, expected_version=v)) == before
    with pytest.raises(WeightVersionMismatch, match=f"serves weight version {v}, the caller expects {v + 7}"):
        client.generate(PROMPTS, GREEDY, expected_version=v + 7)
    with pytest.raises(RequestRefused, match="outside the vocabulary"):
        client.generate([[TINY.vocab_size + 5]], GREEDY)


def test_update_from_tensor_payload(server, monkeypatch):
    """A streamed shared-memory transfer payload (k3core.transfer.send_shm_stream) through
    /update_weights_from_tensor; one whose bytes were corrupted in the ring is refused with the
    engine untouched, and a malformed one too."""
    from k3core import transfer
    from k3core.transfer import stream

    client, ckpts = server["client"], server["ckpts"]
    v = client.weight_version()
    state = load_model(ckpts["b"], dtype=torch.float32).state_dict()  # the served engine's dtypes
    want = _outputs(server["local"]["b"].generate(PROMPTS, GREEDY))
    real_fill = stream._fill

    def corrupting_fill(dst, src):  # one byte flipped in shared memory after the sender copied it
        real_fill(dst, src)
        dst[0] ^= 0x01

    monkeypatch.setattr(stream, "_fill", corrupting_fill)
    with transfer.send_shm_stream(state, v + 1, ring=2, bucket_bytes=1 << 20) as sent:
        with pytest.raises(WeightUpdateRefused, match="corrupt bucket"):
            client.update_weights_from_tensor(sent.payload)
    monkeypatch.setattr(stream, "_fill", real_fill)
    assert client.weight_version() == v
    with pytest.raises(WeightUpdateRefused, match="transport"):
        client.update_weights_from_tensor({"format": "k3rl.weights/1", "transport": "shm", "weight_version": v + 1})
    with transfer.send_shm_stream(state, v + 1, ring=2, bucket_bytes=1 << 20) as sent:
        ans = client.update_weights_from_tensor(sent.payload)
        sent.wait(60)
    assert ans["success"] and client.weight_version() == v + 1
    assert _outputs(client.generate(PROMPTS, GREEDY, expected_version=v + 1)) == want


def test_overload_answers_503_and_the_client_says_so(server):
    client = RolloutClient(server["client"].target, timeout=30, retries=1, backoff=0.01)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "n": 65}}  # > --max-queue 64
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(server["port"], "/generate", body)
    assert e.value.code == 503 and "overloaded" in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(ServerOverloaded, match="503 2 times"):
        client._ok("POST", "/generate", body)
    assert client.health()  # still serving


def test_client_errors_for_a_dead_server():
    port = _free_port()  # nothing listens there
    client = RolloutClient(f"http://127.0.0.1:{port}", timeout=5, retries=2, backoff=0.01)
    assert not client.health()
    with pytest.raises(ServerUnavailable, match=f"127.0.0.1:{port} is not reachable.*after 3 attempts"):
        client.generate([[1, 2]], GREEDY)
    with pytest.raises(ServerUnavailable):
        client.update_weights_from_disk("/nowhere", 1)
    with pytest.raises(ServerUnavailable, match="not healthy"):
        client.wait_ready(timeout=0.3)
    with pytest.raises(ValueError, match="'local' or an http"):
        RolloutClient("ftp://x")


def test_update_from_a_write_disk_directory_checks_digests(server, tmp_path):
    """A directory published by k3core.transfer.write_disk: its declared version is used when the
    request names none, and a flipped byte in a shard is refused with the old version serving."""
    transfer = pytest.importorskip("k3core.transfer")
    client, port = server["client"], server["port"]
    v = client.weight_version()
    model = load_model(server["ckpts"]["a"], dtype=torch.float32)
    transfer.write_disk(tmp_path / "w", model, model.config, v + 1)
    shard = next((tmp_path / "w").glob("*.safetensors"))
    good = shard.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    shard.write_bytes(bytes(bad))
    with pytest.raises(WeightUpdateRefused, match="refused"):
        client.update_weights_from_disk(str(tmp_path / "w"), v + 1)
    assert client.weight_version() == v
    shard.write_bytes(good)
    ans = _post(port, "/update_weights_from_disk", {"model_path": str(tmp_path / "w")})  # no weight_version
    assert ans["success"] and ans["weight_version"] == v + 1 == client.weight_version()
    assert _outputs(client.generate(PROMPTS, GREEDY)) == _outputs(server["local"]["a"].generate(PROMPTS, GREEDY))
