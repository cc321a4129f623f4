"""RolloutClient against SGLang's own request and response types, over real loopback HTTP.

The server here is a plain HTTP server on 127.0.0.1 whose every decision is SGLang's code: requests are
parsed as SGLang's HTTP layer does (``GenerateReqInput``, then ``normalize_batch_and_arguments``) and
their sampling parameters as its tokenizer manager does (``SamplingParams(**...)``, ``normalize``,
``verify``); answers carry the fields SGLang's tokenizer manager fills, built with
SGLang's helpers (``FINISH_LENGTH``/``FINISH_MATCHED_TOKEN.to_json``, ``detokenize_logprob_tokens``,
``compute_weight_version_spans`` + ``add_weight_versions_to_meta_info``); ``/get_server_info`` answers
SGLang's ``build_server_info`` of real ``ServerArgs`` with the ``version`` its HTTP server adds. The model
is not run: the tokens are arbitrary, what is checked is that both sides understand each other.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import sglang_cpu
from k3core.checkpoint.hf import init_checkpoint
from k3core.config import K3Config, mxfp4_quantization_config
from k3core.rollout.client import RolloutClient, ServerWouldComputeWrongly, WeightVersionMismatch
from k3core.rollout.engine import SamplingParams as K3SamplingParams
from k3core.rollout.sglang_serving import SGLANG_CHECKED_VERSION, is_sglang, serving_problems

CONFIG = K3Config.preset("tiny")
N_MOE, TOPK = len(CONFIG.moe_layers), CONFIG.num_experts_per_token


@pytest.fixture(scope="module")
def sg():
    sglang_cpu.install_cpu_stubs()
    import sglang
    from sglang.srt.managers import io_struct, schedule_batch
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.sampling import sampling_params
    from sglang.srt.utils import common, weight_versions

    assert sglang.__version__ == SGLANG_CHECKED_VERSION
    return dict(sglang=sglang, io_struct=io_struct, schedule_batch=schedule_batch, tm=TokenizerManager,
                sampling_params=sampling_params, common=common, weight_versions=weight_versions)


def sglang_server_info(sg, model_path, **server_args) -> dict:
    """What SGLang's ``/get_server_info`` answers (its HTTP server adds ``version`` and ``frontend``)."""
    sa = sglang_cpu.server_args(str(model_path), **server_args)
    info = sg["common"].build_server_info(sa, {})
    return json.loads(json.dumps({**info, "version": sg["sglang"].__version__, "frontend": "python"}, default=str))


class _SGLangShapedServer:
    """Loopback HTTP server; ``mixed_versions``: report each sample as generated under versions 3 then 4."""

    def __init__(self, sg, server_info: dict, mixed_versions: bool = False):
        self.sg, self.server_info, self.mixed = sg, server_info, mixed_versions
        self.requests, self.errors, self.updates = [], [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, obj):
                raw = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/get_server_info":
                    return self._send(200, outer.server_info)
                if self.path == "/get_model_info":
                    return self._send(200, {"model_path": outer.server_info["model_path"], "weight_version": "3",
                                            "is_generation": True, "model_type": "kimi_k3"})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/update_weights_from_disk":
                    outer.updates.append(body)
                    return self._send(200, {"success": True, "message": "ok"})
                try:
                    self._send(200, outer.generate(body))
                except Exception as e:  # noqa: BLE001 - the test reads every refusal
                    outer.errors.append(repr(e))
                    self._send(400, {"error": {"message": repr(e)}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def generate(self, body: dict) -> dict:
        sg = self.sg
        req = sg["io_struct"].GenerateReqInput(**body)  # unknown fields: TypeError
        req.normalize_batch_and_arguments()
        SP = sg["sampling_params"].SamplingParams
        sp = SP(**body["sampling_params"])  # as TokenizerManager builds it: unknown fields are a TypeError
        sp.normalize(None)
        sp.verify(CONFIG.vocab_size)
        self.requests.append(body)

        n_out, seed = sp.max_new_tokens, sp.sampling_seed
        ids = [(seed + t) % 256 for t in range(n_out)]
        stop = sorted(sp.stop_token_ids or [])
        finish = sg["schedule_batch"].FINISH_LENGTH(length=n_out)
        if stop and seed % 2:  # every other sample ends on a stop token
            ids[-1] = stop[0]
            finish = sg["schedule_batch"].FINISH_MATCHED_TOKEN(matched=stop[0])
        logprobs = [-0.25 - 0.01 * t for t in range(n_out)]
        meta = {"id": f"req-{seed}", "finish_reason": finish.to_json(), "prompt_tokens": len(req.input_ids),
                "completion_tokens": n_out, "cached_tokens": 0, "reasoning_tokens": 0,
                "output_token_logprobs": sg["tm"].detokenize_logprob_tokens(None, logprobs, ids, False)}
        wv = sg["weight_versions"]
        events = [wv.WeightVersionEvent(old_version="3", num_output_tokens=1)] if self.mixed else []
        spans = wv.compute_weight_version_spans(events, "4" if self.mixed else "3", n_out)
        wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n_out)
        if body.get("return_routed_experts"):
            # int32 [positions, MoE layers, top-k], base64 of the raw bytes (tokenizer_manager.py)
            routed = np.arange((len(req.input_ids) + n_out - 1) * N_MOE * TOPK, dtype=np.int32) % CONFIG.num_experts
            meta["routed_experts"] = base64.b64encode(routed.tobytes()).decode()
        return {"output_ids": ids, "meta_info": json.loads(json.dumps(meta))}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(sg, tmp_path):
    init_checkpoint("tiny", tmp_path / "ckpt")
    s = _SGLangShapedServer(sg, sglang_server_info(sg, tmp_path / "ckpt"))
    yield s
    s.close()


def test_rollout_requests_validate_and_answers_parse(server):
    client = RolloutClient(server.url, config=CONFIG, retries=0, timeout=30)
    params = K3SamplingParams(n=3, max_new_tokens=5, temperature=0.8, top_p=0.9, top_k=20, seed=11,
                              stop_token_ids=(CONFIG.eos_token_id,))
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    comps = client.generate(prompts, params, expected_version=3)
    assert server.errors == [] and len(server.requests) == 6
    assert all(r["sampling_params"]["n"] == 1 and r["return_logprob"] for r in server.requests)
    assert len(comps) == 6
    for c in comps:
        assert c.weight_version == 3 and len(c.logprobs) == len(c.output_ids) == 5
        assert c.logprobs[0] == pytest.approx(-0.25)
        assert c.routing.shape == (len(prompts[c.prompt_index]) + 5 - 1, N_MOE, TOPK)
    reasons = {c.finish_reason for c in comps}
    assert reasons == {"length", "stop"}
    assert all(c.meta["matched"] == CONFIG.eos_token_id for c in comps if c.finish_reason == "stop")


def test_a_sample_generated_under_two_weight_versions_is_refused(sg, tmp_path):
    init_checkpoint("tiny", tmp_path / "ckpt")
    s = _SGLangShapedServer(sg, sglang_server_info(sg, tmp_path / "ckpt"), mixed_versions=True)
    try:
        client = RolloutClient(s.url, config=CONFIG, retries=0, timeout=30)
        with pytest.raises(WeightVersionMismatch, match=r"under weight versions \['3', '4'\]"):
            client.generate([[1, 2]], K3SamplingParams(n=1, max_new_tokens=4, seed=2))
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------------------
# Refusing a push that SGLang would compute wrongly


def test_decision_on_sglang_server_info(sg, tmp_path):
    init_checkpoint("tiny", tmp_path / "tiny")
    info = sglang_server_info(sg, tmp_path / "tiny")
    assert is_sglang(info) and not is_sglang({"detail": "Not Found"}) and not is_sglang(None)
    assert serving_problems(K3Config.preset("serve-small"), info) == []
    (p,) = serving_problems(CONFIG, info)
    assert "hidden_size 64 is not a multiple of 1024" in p and "serve-small" in p
    half = sglang_server_info(sg, tmp_path / "tiny", dtype="float16")
    assert any("--dtype float16" in p for p in serving_problems(K3Config.preset("serve-small"), half))
    mx = K3Config.preset("serve-small").replace(quantization_config=mxfp4_quantization_config())
    fp8 = sglang_server_info(sg, tmp_path / "tiny", quantization="fp8")
    assert any("--quantization fp8" in p for p in serving_problems(mx, fp8))
    ct = sglang_server_info(sg, tmp_path / "tiny", quantization="compressed-tensors")
    assert serving_problems(mx, ct) == []
    assert any("--quantization compressed-tensors" in p for p in serving_problems(K3Config.preset("serve-small"), ct))


def test_push_to_sglang_that_would_compute_wrongly_is_refused(server, tmp_path):
    client = RolloutClient(server.url, config=CONFIG, retries=0, timeout=30)
    with pytest.raises(ServerWouldComputeWrongly, match="hidden_size 64 is not a multiple of 1024") as e:
        client.update_weights_from_disk(str(tmp_path / "ckpt"), 4)
    assert e.value.status == 409 and server.updates == []  # nothing was sent
    assert isinstance(e.value, ValueError)  # bad input: the stages do not retry it
    ok = tmp_path / "serve-small"
    ok.mkdir()
    K3Config.preset("serve-small").to_json_file(ok / "config.json")
    assert client.update_weights_from_disk(str(ok), 4)["success"]
    assert server.updates == [{"model_path": str(ok), "weight_version": 4}]
