"""K2/K3 tool-call text: what a chat template renders for an assistant's ``tool_calls``, and what a
completion's text is read back into.

Owns: the section format and its parser. Does not own: tool execution or the declaration of tools
(the template renders those). The format, byte for byte::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json args}<|tool_call_end|>
    ... one per call ...
    <|tool_calls_section_end|>

(on one line: no whitespace between the markers). ``parse_assistant_text`` never raises on model
output: a malformed section or call becomes an entry of ``errors`` saying what is wrong and where,
and the calls that did parse are kept. ``parse_assistant_text(content + format_tool_calls(calls))``
gives back ``content`` and ``calls``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

_CALL_ID = re.compile(r"functions\.(?P<name>[^\s:<>]+):(?P<index>\d+)")


@dataclass(frozen=True)
class ToolCall:
    id: str  # "functions.NAME:IDX"
    name: str
    index: int
    arguments: dict

    def to_openai(self) -> dict:
        """The OpenAI-style dict a chat message's ``tool_calls`` holds (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class ParsedAssistant:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _arguments_text(arguments) -> str:
    """A string is written as given; a dict as the template's ``tojson`` writes it."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def format_tool_calls(calls) -> str:
    """The section for ``calls`` (OpenAI-style dicts, or ``ToolCall``); a call without an ``id`` gets
    ``functions.NAME:POSITION``. An empty list renders nothing."""
    if not calls:
        return ""
    parts = [SECTION_BEGIN]
    for position, call in enumerate(calls):
        if isinstance(call, ToolCall):
            call = call.to_openai()
        fn = call["function"]
        call_id = call.get("id") or f"functions.{fn['name']}:{position}"
        parts.append(f"{CALL_BEGIN}{call_id}{ARGUMENT_BEGIN}{_arguments_text(fn.get('arguments', {}))}{CALL_END}")
    parts.append(SECTION_END)
    return "".join(parts)


def _parse_call(body: str, number: int, errors: list[str]) -> ToolCall | None:
    """One call's text between ``<|tool_call_begin|>`` and ``<|tool_call_end|>``."""
    if ARGUMENT_BEGIN not in body:
        errors.append(f"tool call {number}: no {ARGUMENT_BEGIN} after its id {body[:60]!r}")
        return None
    call_id, args_text = body.split(ARGUMENT_BEGIN, 1)
    m = _CALL_ID.fullmatch(call_id.strip())
    if m is None:
        errors.append(f"tool call {number}: id {call_id[:60]!r} is not of the form functions.NAME:INDEX")
        return None
    try:
        arguments = json.loads(args_text)
    except json.JSONDecodeError as e:
        errors.append(f"tool call {number} ({call_id.strip()}): arguments are not valid JSON ({e.msg} at char "
                      f"{e.pos}): {args_text[:60]!r}")
        return None
    if not isinstance(arguments, dict):
        errors.append(f"tool call {number} ({call_id.strip()}): arguments must be a JSON object, got "
                      f"{type(arguments).__name__}")
        return None
    return ToolCall(id=call_id.strip(), name=m["name"], index=int(m["index"]), arguments=arguments)


def _parse_section(body: str, first_number: int, errors: list[str]) -> list[ToolCall]:
    """The calls of one section's body; anything but whitespace between calls is an error."""
    calls, pos, number = [], 0, first_number
    while pos < len(body):
        start = body.find(CALL_BEGIN, pos)
        gap = body[pos:] if start < 0 else body[pos:start]
        if gap.strip():
            errors.append(f"text between tool calls (after call {number - 1}): {gap.strip()[:60]!r}")
        if start < 0:
            break
        end = body.find(CALL_END, start)
        nxt = body.find(CALL_BEGIN, start + len(CALL_BEGIN))
        if end < 0 or 0 <= nxt < end:
            errors.append(f"tool call {number}: {CALL_BEGIN} is never closed by {CALL_END}")
            pos = len(body) if nxt < 0 else nxt
        else:
            call = _parse_call(body[start + len(CALL_BEGIN):end], number, errors)
            if call is not None:
                calls.append(call)
            pos = end + len(CALL_END)
        number += 1
    return calls


def parse_assistant_text(text: str) -> ParsedAssistant:
    """Split an assistant's text into its content (the text outside tool-call sections) and its
    calls. Never raises; see the module docstring."""
    out, pos = ParsedAssistant(content=""), 0
    content: list[str] = []
    while True:
        start = text.find(SECTION_BEGIN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        body_start = start + len(SECTION_BEGIN)
        end = text.find(SECTION_END, body_start)
        if end < 0:
            out.errors.append(f"tool-call section at char {start} is never closed by {SECTION_END}")
            end = len(text)
        out.tool_calls += _parse_section(text[body_start:end], len(out.tool_calls) + 1, out.errors)
        pos = min(len(text), end + len(SECTION_END))
    out.content = "".join(content)
    for marker in (CALL_BEGIN, CALL_END, ARGUMENT_BEGIN, SECTION_END):
        if marker in out.content:
            out.errors.append(f"{marker} outside a {SECTION_BEGIN} section")
    return out


def final_answer(completion: str) -> str:
    """The content of the last assistant turn of a trajectory's text (an episode's completion)."""
    last = completion.rsplit("<|im_assistant|>assistant<|im_middle|>", 1)[-1]
    return parse_assistant_text(last.split("<|im_end|>", 1)[0]).content.strip()
