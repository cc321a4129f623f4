"""SGLang's tokenizer path on a k3rl checkpoint that carries the bundled BPE: SGLang's own
``get_tokenizer`` (what its server runs without ``--skip-tokenizer-init``) loads it without remote
code and gives the ids of ``k3core.tokenizer.load_tokenizer``, for text and for chat turns with
tools, and decodes them back; and it stops where k3rl stops (eos and ``<|im_end|>``)."""

from __future__ import annotations

import pytest

import sglang_cpu
from k3core.checkpoint.hf import init_checkpoint
from k3core.tokenizer import load_tokenizer

TEXTS = ["rev:abcd=", "Hello, World! It's 2026: 12345 + 678 = ?", "中文混合 English 和数字 42",
         "  leading   runs\n\n\ttabs", "<|im_user|>user<|im_middle|>look-alike <|im_end|> <im_end>"]
TOOLS = [{"type": "function", "function": {"name": "run", "description": "run a shell command",
                                            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "list the files"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "functions.run:0", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"ls\"}"}}]},
            {"role": "tool", "tool_call_id": "functions.run:0", "content": "a.py b.py"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "ck"
    init_checkpoint("tiny", path, seed=0, tokenizer="bpe")
    return path


def test_sglang_get_tokenizer_gives_k3rls_ids(checkpoint):
    get_tokenizer = sglang_cpu.import_sglang("sglang.srt.utils.hf_transformers_utils").get_tokenizer
    theirs, ours = get_tokenizer(str(checkpoint), trust_remote_code=False), load_tokenizer(checkpoint)
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids, text
        assert theirs.decode(ids) == ours.decode(ids) == text
    rendered = theirs.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert rendered == ours.render_chat(MESSAGES, tools=TOOLS)
    assert theirs.encode(rendered, add_special_tokens=False) == ours.apply_chat_template(MESSAGES, tools=TOOLS)
    assert theirs.eos_token_id in ours.stop_ids
    assert theirs.convert_tokens_to_ids("<|im_end|>") in ours.stop_ids
