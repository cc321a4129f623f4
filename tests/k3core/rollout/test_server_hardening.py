"""The rollout server under hostile or careless clients: a real ``k3rl rollout-server`` subprocess on
127.0.0.1 with an API key and small limits. Every refusal is a 4xx (or 503 with Retry-After) naming
the problem, valid requests beside it still succeed, a disconnected client's generation stops, and
weight updates come only from the configured root, finite and not older. References: the same
server's answers to valid requests, and its weight version before each refused update."""

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from flows.cli_serve import launch
from k3core.checkpoint.hf import init_checkpoint, load_model, save_hf
from k3core.rollout.client import RequestRefused, RolloutClient, WeightUpdateRefused
from k3core.rollout.engine import SamplingParams

KEY = "test-key-0123456789"
GREEDY = SamplingParams(max_new_tokens=4, temperature=0)
PROMPTS = [[256, 72, 105], [256, 9]]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("hard")
    allowed, outside = root / "allowed", root / "outside"
    init_checkpoint("tiny", allowed / "a", seed=0)
    init_checkpoint("tiny", allowed / "b", seed=1)
    init_checkpoint("tiny", outside / "c", seed=2)
    proc, client = launch(allowed / "a", "--weight-root", str(allowed), "--max-body-bytes", "4096", "--max-update-body-bytes", "65536",
                          "--max-prompt-tokens", "32", "--max-new-tokens-cap", "100000", "--max-concurrent-requests", "4",
                          "--body-timeout", "2", log_path=root / "server.log", env={"OMP_NUM_THREADS": "1", "K3RL_ROLLOUT_API_KEY": KEY},
                          timeout=60, retries=1, backoff=0.05, api_key=KEY)
    port = int(client.url.rsplit(":", 1)[1])
    yield {"client": client, "port": port, "root": root, "allowed": allowed, "outside": outside, "log": root / "server.log"}
    proc.terminate()
    proc.wait(20)


def post(port, path, body, key=KEY, raw: bytes | None = None):
    """(status, parsed body, headers) of a POST; ``raw`` sends those bytes as the body."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), e.headers


def gen(ids, **sp):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, **sp}}


def message(body) -> str:
    return (body.get("error") or {}).get("message", "") if isinstance(body, dict) else ""


def test_api_key_is_required_except_for_health(srv, monkeypatch):
    port = srv["port"]
    assert post(port, "/generate", gen([256, 1]), key=None)[0] == 401
    status, body, _ = post(port, "/generate", gen([256, 1]), key="wrong")
    assert status == 401 and "Authorization: Bearer" in message(body)
    assert post(port, "/update_weights_from_disk", {"model_path": str(srv["allowed"] / "b")}, key=None)[0] == 401
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        assert r.status == 200
    assert post(port, "/generate", gen([256, 1]))[0] == 200
    monkeypatch.delenv("K3RL_ROLLOUT_API_KEY", raising=False)
    with pytest.raises(RequestRefused, match="401"):
        RolloutClient(srv["client"].target, retries=0).weight_version()
    monkeypatch.setenv("K3RL_ROLLOUT_API_KEY", KEY)  # what `k3rl run --rollout-url` reads
    assert RolloutClient(srv["client"].target, retries=0).weight_version() == srv["client"].weight_version()


def test_non_loopback_bind_without_a_key_is_refused(srv, capsys):
    from flows.cli import main

    env = os.environ.pop("K3RL_ROLLOUT_API_KEY", None)
    try:
        assert main(["rollout-server", "--checkpoint", str(srv["allowed"] / "a"), "--host", "0.0.0.0"]) == 2
    finally:
        if env is not None:
            os.environ["K3RL_ROLLOUT_API_KEY"] = env
    assert "--api-key" in capsys.readouterr().err


@pytest.mark.parametrize("sp, needle", [
    ({"max_new_tokens": 10**9}, "max_new_tokens must be an integer in [1, 100000]"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
    ({"top_k": 1e30}, "top_k must be an integer in [-1, 1073741824]"),
    ({"top_p": 2}, "top_p must be a finite number in (0.0, 1.0]"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"n": "3"}, "n must be an integer"),
    ({"seed": -1}, "seed must be an integer in [0,"),
    ({"stop_token_ids": [10**12]}, "stop_token_ids"),
])
def test_bad_sampling_params_answer_400_naming_the_field(srv, sp, needle):
    status, body, _ = post(srv["port"], "/generate", gen([256, 1], **sp))
    assert status == 400 and needle in message(body)


def test_a_bad_request_does_not_fail_the_ones_beside_it(srv):
    def outputs():
        status, body, _ = post(srv["port"], "/generate", gen(PROMPTS))
        return status, [o["output_ids"] for o in body] if status == 200 else body
    want = outputs()
    results = {}

    def bad(i):
        results[("bad", i)] = post(srv["port"], "/generate", gen([256, 1], top_k=1e30))[0]

    def good(i):
        results[("good", i)] = outputs()
    threads = [threading.Thread(target=f, args=(i,)) for i in range(2) for f in (bad, good)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(v == 400 for k, v in results.items() if k[0] == "bad"), results
    assert all(v == want for k, v in results.items() if k[0] == "good")


def test_top_k_beyond_the_vocabulary_means_no_filter(srv):
    sp = {"temperature": 1.0, "seed": 5, "max_new_tokens": 8}
    _, plain, _ = post(srv["port"], "/generate", gen([256, 3], **sp))
    status, huge, _ = post(srv["port"], "/generate", gen([256, 3], top_k=1 << 30, **sp))
    assert status == 200 and huge["output_ids"] == plain["output_ids"]


def test_body_and_prompt_limits(srv):
    status, body, _ = post(srv["port"], "/generate", None, raw=json.dumps({"text": "x" * 5000}).encode())
    assert status == 413 and "--max-body-bytes" in message(body)
    status, body, _ = post(srv["port"], "/generate", gen([256] + [1] * 32))
    assert status == 400 and "prompt 0 has 33 tokens, the limit is 32" in message(body)
    status, body, _ = post(srv["port"], "/generate", None, raw=b"{not json")
    assert status == 400 and "not JSON" in message(body)
    # weight updates have their own limit (transfer payloads list every tensor)
    status, body, _ = post(srv["port"], "/update_weights_from_disk", {"model_path": "/x" + "y" * 5000})
    assert status == 403  # past the body check: refused for its path
    status, body, _ = post(srv["port"], "/update_weights_from_disk", {"model_path": "/x" + "y" * 70000})
    assert status == 413 and "--max-update-body-bytes" in body["message"]


def _raw_generate(port: int, max_new_tokens: int) -> socket.socket:
    """An open connection whose /generate asks for many tokens (closed by the caller to disconnect)."""
    body = json.dumps({"input_ids": [256, 5], "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                  "ignore_eos": True}}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _load(srv) -> dict:
    with urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{srv['port']}/get_model_info", headers={"Authorization": f"Bearer {KEY}"}),
            timeout=10) as r:
        return json.loads(r.read())["load"]


def _wait_for(cond, what: str, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def test_concurrency_limit_503_and_disconnect_cancels_generation(srv):
    """Four requests of 100000 tokens fill --max-concurrent-requests 4: a fifth answers 503 with
    Retry-After. Closing their connections ends their generation (it would otherwise run for many
    minutes), and the server takes requests again."""
    socks = [_raw_generate(srv["port"], 100000) for _ in range(4)]
    try:
        _wait_for(lambda: _load(srv)["running"] == 4, "the long requests to run")
        status, body, headers = post(srv["port"], "/generate", gen([256, 1]))
        assert status == 503 and headers["Retry-After"] == "1" and "--max-concurrent-requests" in message(body)
    finally:
        for s in socks:
            s.close()
    _wait_for(lambda: _load(srv)["running"] == 0 and _load(srv)["waiting"] == 0, "generation to be cancelled")
    assert post(srv["port"], "/generate", gen([256, 1]))[0] == 200


def _partial_body(port: int, declared: int, sent: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {declared}\r\n\r\n".encode() + sent)
    return s


def test_a_slow_body_times_out_and_a_client_gone_mid_body_is_one_log_line(srv):
    """Four clients that send half a body and then nothing would hold every slot of
    --max-concurrent-requests 4 for as long as they like: each gets 408 after --body-timeout (2 s)
    and the server answers again. A client that disconnects mid-body leaves one line in the log,
    not a traceback."""
    slow = [_partial_body(srv["port"], 100, b'{"input_ids": ') for _ in range(4)]
    try:
        for s in slow:
            s.settimeout(30)
            answer = b""
            while b"--body-timeout" not in answer and (chunk := s.recv(4096)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer, answer
    finally:
        for s in slow:
            s.close()
    assert post(srv["port"], "/generate", gen([256, 1]))[0] == 200
    before = srv["log"].read_text()
    gone = _partial_body(srv["port"], 100, b'{"input_ids": ')
    time.sleep(0.3)
    gone.close()
    _wait_for(lambda: "disconnected before its request body was read" in srv["log"].read_text()[len(before):],
              "the disconnect's log line", 20)
    assert post(srv["port"], "/generate", gen([256, 1]))[0] == 200
    new = srv["log"].read_text()[len(before):]
    assert "Traceback" not in new and new.count("disconnected before its request body was read") == 1, new


def test_weight_updates_only_from_the_root_finite_and_not_older(srv, tmp_path):
    client, allowed, outside = srv["client"], srv["allowed"], srv["outside"]
    v = client.weight_version()
    before = [c.output_ids for c in client.generate(PROMPTS, GREEDY)]

    status, body, _ = post(srv["port"], "/update_weights_from_disk", {"model_path": str(outside / "c"),
                                                                     "weight_version": v + 1})
    assert status == 403 and "--weight-root" in body["message"]
    (allowed / "link").symlink_to(outside / "c")  # inside by name, outside in fact
    status, body, _ = post(srv["port"], "/update_weights_from_disk", {"model_path": str(allowed / "link"),
                                                                     "weight_version": v + 1})
    assert status == 403
    status, _, _ = post(srv["port"], "/update_weights_from_disk", {"model_path": str(allowed / "a" / ".." / ".." /
                                                                                     "outside" / "c")})
    assert status == 403

    model = load_model(allowed / "b", dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[3, 7] = float("nan")
    save_hf(model, allowed / "nan")
    with pytest.raises(WeightUpdateRefused, match="non-finite"):
        client.update_weights_from_disk(str(allowed / "nan"), v + 1)
    assert client.weight_version() == v
    assert [c.output_ids for c in client.generate(PROMPTS, GREEDY)] == before

    # a version is a non-negative integer in a JSON number: a string cannot step around the order
    for bad in ("v-rollback", "\u00b3", str(v + 9), -1, 2.5, True):
        status, body, _ = post(srv["port"], "/update_weights_from_disk", {"model_path": str(allowed / "b"),
                                                                         "weight_version": bad})
        assert status == 400 and "weight_version" in body["message"], (bad, status, body)
    assert client.weight_version() == v

    client.update_weights_from_disk(str(allowed / "b"), v + 5)
    with pytest.raises(WeightUpdateRefused, match=f"weight version {v + 3} is older than the served {v + 5}"):
        client.update_weights_from_disk(str(allowed / "a"), v + 3)
    assert client.weight_version() == v + 5
    assert client.update_weights_from_disk(str(allowed / "b"), v + 5)["success"]  # the same version again: a retry
