"""Tool-call text: the bundled template renders what ``format_tool_calls`` writes, parsing gives the
calls back, and malformed text gives reasons, never exceptions."""

import json

import pytest

from k3core.tokenizer import load_tokenizer
from k3core.tokenizer.tool_calls import ToolCall, format_tool_calls, parse_assistant_text

CALLS = [
    {"id": "functions.get_weather:0", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "São Paulo", "unit": "celsius"}}},
    {"id": "functions.search.web:1", "type": "function",
     "function": {"name": "search.web", "arguments": '{"query": "k3 <tokenizer>", "limit": 3}'}},
]


def test_format_matches_the_template(bundled):
    tok = load_tokenizer(bundled)
    chat = [{"role": "assistant", "content": "Let me look.", "tool_calls": CALLS}]
    rendered = tok.render_chat(chat, add_generation_prompt=False)
    assert ("<|im_middle|>Let me look." + format_tool_calls(CALLS) + "<|im_end|>") in rendered


def test_render_then_parse_round_trips(bundled):
    text = "Let me look." + format_tool_calls(CALLS)
    parsed = parse_assistant_text(text)
    assert parsed.errors == [] and parsed.content == "Let me look."
    assert parsed.tool_calls == [
        ToolCall("functions.get_weather:0", "get_weather", 0, {"city": "São Paulo", "unit": "celsius"}),
        ToolCall("functions.search.web:1", "search.web", 1, {"query": "k3 <tokenizer>", "limit": 3})]
    again = format_tool_calls(parsed.tool_calls)
    assert parse_assistant_text(again).tool_calls == parsed.tool_calls
    # through the ids too: the markers are special tokens and come back from decode
    tok = load_tokenizer(bundled)
    assert parse_assistant_text(tok.decode(tok.encode(text))).tool_calls == parsed.tool_calls
    assert json.loads(parsed.tool_calls[0].to_openai()["function"]["arguments"])["city"] == "São Paulo"


def test_calls_without_ids_are_numbered():
    calls = [{"function": {"name": "f", "arguments": {}}}, {"function": {"name": "g", "arguments": {"x": 1}}}]
    assert [c.id for c in parse_assistant_text(format_tool_calls(calls)).tool_calls] == ["functions.f:0",
                                                                                         "functions.g:1"]
    assert format_tool_calls([]) == "" and parse_assistant_text("plain") .tool_calls == []


B, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
GOOD = f"{CB}functions.f:0{AB}{{}}{CE}"


@pytest.mark.parametrize("text, reason", [
    (f"hi{B}{GOOD}", "never closed by <|tool_calls_section_end|>"),
    (f"{B}{CB}get_weather:0{AB}{{}}{CE}{E}", "not of the form functions.NAME:INDEX"),
    (f"{B}{CB}functions.f{AB}{{}}{CE}{E}", "not of the form functions.NAME:INDEX"),
    (f"{B}{CB}functions.f:0{AB}{{'city': 1}}{CE}{E}", "not valid JSON"),
    (f"{B}{CB}functions.f:0{AB}[1, 2]{CE}{E}", "must be a JSON object, got list"),
    (f"{B}{GOOD} and then {GOOD}{E}", "text between tool calls"),
    (f"{B}{CB}functions.f:0{AB}{{}}{E}", "never closed by <|tool_call_end|>"),
    (f"{B}{CB}functions.f:0{{}}{CE}{E}", "no <|tool_call_argument_begin|>"),
    (f"stray {CB} marker", "outside a <|tool_calls_section_begin|> section"),
])
def test_malformed_text_gives_a_reason(text, reason):
    parsed = parse_assistant_text(text)
    assert any(reason in e for e in parsed.errors), parsed.errors


def test_good_calls_survive_a_bad_neighbour():
    parsed = parse_assistant_text(f"{B}{CB}functions.g:0{AB}not json{CE}{GOOD}{E}tail")
    assert [c.id for c in parsed.tool_calls] == ["functions.f:0"] and len(parsed.errors) == 1
    assert parsed.content == "tail"
