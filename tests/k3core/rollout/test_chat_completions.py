"""``/v1/chat/completions`` on a real server subprocess (127.0.0.1) serving a tiny checkpoint that
carries the bundled BPE: the prompt is the chat template's rendering of the messages and tools, the
sampled ids and log-probabilities equal the in-process engine's for the same prompt and seed, the
answer's text is the decoded ids split into content and tool calls; bad requests get a 400 naming
the field. The answer builder is also checked on completions that hold tool-call sections, well
formed and not."""

import json
import urllib.error
import urllib.request

import pytest
import torch

from flows.cli_serve import launch
from k3core.checkpoint.hf import init_checkpoint
from k3core.rollout.checkpoints import engine_from_checkpoint
from k3core.rollout.engine import Completion, SamplingParams
from k3core.tokenizer import load_tokenizer
from k3core.tokenizer.tool_calls import format_tool_calls

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                            "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                           "required": ["path"]}}}]
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "What is in setup.py?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "functions.read_file:0", "type": "function",
                 "function": {"name": "read_file", "arguments": "{\"path\": \"setup.py\"}"}}]},
            {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "from setuptools import setup"},
            {"role": "user", "content": "Summarise it."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    init_checkpoint("tiny", root / "bpe", seed=0, tokenizer="bpe")
    init_checkpoint("tiny", root / "bytes", seed=0)
    proc, client = launch(root / "bpe", "--max-batch", "8", log_path=root / "server.log",
                          env={"OMP_NUM_THREADS": "1"}, timeout=60, retries=2, backoff=0.05)
    byte_proc, byte_client = launch(root / "bytes", log_path=root / "bytes.log", env={"OMP_NUM_THREADS": "1"},
                                    timeout=60, retries=2, backoff=0.05)
    yield {"url": client.url, "bytes_url": byte_client.url, "tok": load_tokenizer(root / "bpe"),
           "engine": engine_from_checkpoint(root / "bpe")}
    for p in (proc, byte_proc):
        p.terminate()
        p.wait(20)


def _post(url, path, body):
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _one_request(engine, prompt, params):
    """The completions of one request as the server submits it (its seed is the request's own)."""
    (future,) = engine.submit_many([(prompt, params, None)], bounded=False)
    while not future.done():
        engine.step()
    return future.result()


def test_chat_completion_samples_the_rendered_prompt_like_the_engine(served):
    tok = served["tok"]
    status, out = _post(served["url"], "/v1/chat/completions", {
        "messages": MESSAGES, "tools": TOOLS, "max_tokens": 12, "temperature": 1.0, "n": 2, "seed": 7,
        "logprobs": True, "return_token_ids": True})
    assert status == 200, out
    prompt = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)
    assert out["prompt_token_ids"] == prompt
    want = _one_request(served["engine"], prompt, SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=7,
                                                                 stop_token_ids=tok.stop_ids))
    assert [c["token_ids"] for c in out["choices"]] == [w.output_ids for w in want]
    for choice, w in zip(out["choices"], want):
        got = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
        torch.testing.assert_close(got, torch.tensor(w.logprobs), rtol=0, atol=1e-5)
        ids = w.output_ids[:-1] if w.finish_reason == "stop" else w.output_ids
        text = tok.decode(ids)
        assert choice["message"]["content"] + "".join(
            format_tool_calls(choice["message"].get("tool_calls", []))) == text or choice.get("tool_call_errors")
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": sum(len(w.output_ids) for w in want),
                            "total_tokens": len(prompt) + sum(len(w.output_ids) for w in want)}
    assert out["object"] == "chat.completion" and out["weight_version"] == 0


def test_generate_text_uses_the_checkpoints_tokenizer(served):
    tok = served["tok"]
    status, out = _post(served["url"], "/generate", {"text": "rev:abcd= 你好", "return_logprob": True,
                                                     "sampling_params": {"max_new_tokens": 3, "seed": 1}})
    assert status == 200 and out["meta_info"]["prompt_tokens"] == len(tok.encode("rev:abcd= 你好"))
    assert out["text"] == tok.decode([i for i in out["output_ids"] if i not in tok.stop_ids])


@pytest.mark.parametrize("body, says", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "needs 'tool_call_id'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "streaming is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "'tool_choice'"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "'top_logprobs'"),
    ({"messages": [], "max_tokens": 2}, "'messages'"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1 << 20}, "--max-new-tokens-cap"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "unsupported fields ['response_format']"),
])
def test_bad_chat_requests_are_refused_naming_the_field(served, body, says):
    status, out = _post(served["url"], "/v1/chat/completions", body)
    assert status == 400 and says in out["error"]["message"], out


def test_a_checkpoint_without_a_chat_template_is_refused(served):
    status, out = _post(served["bytes_url"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and "no chat template" in out["error"]["message"]


def _answer(tok, text: str, tools=True, **req):
    from k3core.rollout.chat_completions import ChatRequest, chat_response

    end = tok.special_ids["<|im_end|>"]
    ids = tok.encode(text) + [end]
    c = Completion(0, 0, [1], ids, [-0.5] * len(ids), None, "stop", 3, {"matched": end})
    body = {"messages": [{"role": "user", "content": "x"}], **({"tools": TOOLS} if tools else {}), **req}
    return chat_response([c], tok, ChatRequest.model_validate(body), [1], "r", None)["choices"][0]


def test_tool_call_sections_become_tool_calls_and_malformed_ones_errors(served):
    tok = served["tok"]
    call = {"id": "functions.read_file:0", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": "a.py"})}}
    choice = _answer(tok, "Reading it." + format_tool_calls([call]))
    assert choice["message"] == {"role": "assistant", "content": "Reading it.", "tool_calls": [call]}
    assert choice["finish_reason"] == "tool_calls" and "tool_call_errors" not in choice
    broken = _answer(tok, "x<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0"
                          "<|tool_call_argument_begin|>{not json<|tool_call_end|>")
    assert broken["message"].get("tool_calls") is None and broken["finish_reason"] == "stop"
    assert broken["tool_call_errors"] and any("never closed" in e for e in broken["tool_call_errors"])
    plain = _answer(tok, "Reading it." + format_tool_calls([call]), tools=False)  # no tools: the text as it is
    assert plain["message"]["content"].startswith("Reading it.<|tool_calls_section_begin|>")
