"""Chat rendering against transformers' own ``apply_chat_template``, and the sandbox's refusals."""

import json
import shutil

import pytest

from k3core.config import K3Config
from k3core.tokenizer import ByteTokenizer, ChatTemplateError, load_tokenizer
from k3core.tokenizer.chat import deep_sort

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "city": {"type": "string"}}}}}]

CHATS = {
    "plain": [{"role": "user", "content": "Hi! 你好"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    "tools": [
        {"role": "user", "content": "Weather in Paris and Tokyo? <|im_end|> is text here"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
            {"id": "functions.get_weather:1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "Paris 21 °C, Tokyo 18 °C.", "tool_calls": None}],
}


@pytest.fixture(scope="module")
def auto(bundled):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bundled))


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("with_tools", [False, True])
def test_render_and_ids_equal_transformers(bundled, auto, chat, with_tools):
    tok = load_tokenizer(bundled)
    tools = TOOLS if with_tools else None
    text = tok.render_chat(CHATS[chat], tools=tools)
    sorted_tools = deep_sort(TOOLS) if with_tools else None
    assert text == auto.apply_chat_template(CHATS[chat], tools=sorted_tools, add_generation_prompt=True, tokenize=False)
    ids = auto.apply_chat_template(CHATS[chat], tools=sorted_tools, add_generation_prompt=True, tokenize=True)
    assert tok.apply_chat_template(CHATS[chat], tools=tools) == list(ids["input_ids"])


def test_k3_layout_of_the_bundled_template(bundled):
    tok = load_tokenizer(bundled)
    text = tok.render_chat(CHATS["tools"], tools=TOOLS, add_generation_prompt=False)
    declared = json.dumps(deep_sort(TOOLS), ensure_ascii=False, separators=(",", ":"))
    assert text.startswith(f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>"
                           "<|im_system|>system<|im_middle|>")
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:1\n{\"temp\": 18}<|im_end|>" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>Paris 21 °C, Tokyo 18 °C.<|im_end|>")
    assert tok.render_chat(CHATS["plain"]).endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = tok.apply_chat_template(CHATS["plain"])
    assert ids.count(tok.special_ids["<|im_end|>"]) == 2


def _with_template(tmp_path, bundled, template):
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(bundled / f, tmp_path / f)
    (tmp_path / "chat_template.jinja").write_text(template)
    return load_tokenizer(tmp_path)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ ''.__class__ }}",
    "{% set ns = namespace(__class__=1) %}",
])
def test_sandbox_refuses_python_internals(tmp_path, bundled, template):
    tok = _with_template(tmp_path, bundled, template)
    with pytest.raises(ChatTemplateError, match="sandbox refuses"):
        tok.render_chat(CHATS["plain"])


def test_template_errors_are_clear(tmp_path, bundled):
    tok = _with_template(tmp_path, bundled, "{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.render_chat(CHATS["plain"])
    tok = _with_template(tmp_path, bundled, "{{ raise_exception('no tools, please') }}")
    with pytest.raises(ChatTemplateError, match="no tools, please"):
        tok.render_chat(CHATS["plain"])


def test_chat_template_file_wins_and_named_list_gives_default(tmp_path, bundled):
    assert _with_template(tmp_path, bundled, "FILE").render_chat([]) == "FILE"
    (tmp_path / "chat_template.jinja").unlink()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 + 1 }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(tmp_path).render_chat([]) == "D2"


def test_tojson_and_globals_match_transformers(tmp_path, bundled, auto):
    template = ("{{ messages | tojson }}|{{ messages | tojson(indent=2) }}|{% set ns = namespace(n=0) %}"
                "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% if loop.index > 5 %}{% break %}{% endif %}"
                "{% endfor %}{{ ns.n }}|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') | length }}")
    tok = _with_template(tmp_path, bundled, template)
    chat = [{"role": "user", "content": "<é & ü>", "name": None}]
    assert tok.render_chat(chat) == auto.apply_chat_template(chat, chat_template=template, tokenize=False)


def test_byte_tokenizer_has_no_template_by_default():
    tok = ByteTokenizer(K3Config.preset("tiny"))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="byte tokenizer has no chat template"):
        tok.apply_chat_template(CHATS["plain"])
    templated = ByteTokenizer(K3Config.preset("tiny"), chat_template="{{ messages[0].content }}")
    assert templated.apply_chat_template(CHATS["plain"]) == [templated.bos_id, *"Hi! 你好".encode()]
