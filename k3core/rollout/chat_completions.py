"""OpenAI's ``POST /v1/chat/completions`` over the rollout engine, in the checkpoint's own chat format.

The request's ``messages`` and ``tools`` are rendered with the served checkpoint's chat template
(``k3core.tokenizer``: read from its files, rendered in Jinja's sandbox, never its code); the engine
samples from those ids and stops at the tokenizer's end-of-turn ids; the answer's text is split into
``content`` and ``tool_calls`` (``k3core.tokenizer.tool_calls``, the K2/K3 section format). A
malformed tool-call section is not an error of the request: the calls that parsed are returned, and
``tool_call_errors`` says what was wrong (an agent's environment shows that to the model).

For RL, the token ids are the truth: ``return_token_ids`` adds the prompt's ids (``prompt_token_ids``)
and each choice's sampled ids (``token_ids``), and ``logprobs`` each sampled token's log-probability,
so a trainer trains on what the engine saw and sampled, never on text re-encoded from the answer.

Fields as OpenAI names them; ``top_k``, ``stop_token_ids``, ``seed`` and ``return_token_ids`` as
SGLang and vLLM extend them. Streaming, ``top_logprobs``, ``response_format`` and a forced
``tool_choice`` are refused with a 400 naming the field; penalties other than 0 too.
"""

# no ``from __future__ import annotations``: pydantic reads the field annotations at class creation

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator, model_validator

from k3core.rollout.request_fields import BadRequest, _float, _int, _neutral, _StopString, _switch, register_nested

__all__ = ["ChatMessage", "ChatRequest", "ToolDeclaration", "chat_prompt", "chat_response", "chat_sampling",
           "ended_by_id"]


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[StrictStr, Field(min_length=1, max_length=256, description="a non-empty string")]
    arguments: Annotated[StrictStr | dict | None, Field(description="a JSON string or an object")] = None


class _ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: Annotated[StrictStr | None, Field(description="a string")] = None
    type: Annotated[Literal["function"], Field(description="'function'")] = "function"
    function: _Function


class ChatMessage(BaseModel):
    """One turn: system, user, assistant (with its ``tool_calls``) or tool (a call's result)."""

    model_config = ConfigDict(extra="forbid")

    role: Annotated[Literal["system", "user", "assistant", "tool"],
                    Field(description="'system', 'user', 'assistant' or 'tool'")]
    content: Annotated[StrictStr | list[dict] | None, Field(
        description="a string, a list of {type: 'text', text} parts, or null")] = None
    tool_calls: Annotated[list[_ToolCallIn] | None, Field(
        description="a list of {id, type: 'function', function: {name, arguments}}")] = None
    tool_call_id: Annotated[StrictStr | None, Field(description="a string (the call a tool message answers)")] = None
    name: Annotated[StrictStr | None, Field(description="a string")] = None

    @model_validator(mode="after")
    def _fits_its_role(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id' (the id of the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"'tool_calls' belong to assistant messages, not to a {self.role!r} one")
        if isinstance(self.content, list) and not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in self.content):
            raise ValueError("content parts must be {type: 'text', text: STRING} (no images or audio here)")
        return self


class _FunctionDeclaration(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: Annotated[StrictStr, Field(min_length=1, max_length=256, description="a non-empty string")]
    description: Annotated[StrictStr | None, Field(description="a string")] = None
    parameters: Annotated[dict | None, Field(description="a JSON schema object")] = None


class ToolDeclaration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Annotated[Literal["function"], Field(description="'function'")]
    function: _FunctionDeclaration


class ChatRequest(BaseModel):
    """The body of ``/v1/chat/completions`` (unknown fields refused)."""

    model_config = ConfigDict(extra="forbid")

    messages: Annotated[list[ChatMessage], Field(min_length=1, description="a non-empty list of messages")]
    tools: Annotated[list[ToolDeclaration] | None, Field(
        max_length=256, description="a list of at most 256 {type: 'function', function: {name, description, "
                                    "parameters}}")] = None
    model: Annotated[StrictStr | None, Field(description="a string (any: this server serves one model)")] = None
    max_tokens: _int(1, 1 << 31) = None
    max_completion_tokens: _int(1, 1 << 31) = None
    temperature: _float(0.0, 1e4) = None
    top_p: _float(0.0, 1.0, lo_open=True) = None
    top_k: _int(-1, 1 << 30, " (-1 or 0: off)") = None
    n: _int(1, 1 << 20) = None
    seed: _int(0, (1 << 63) - 1) = None
    stop: Annotated[_StopString | Annotated[list[_StopString], Field(max_length=64)] | None, Field(
        description="a non-empty string or a list of at most 64 of them, each at most 1024 characters")] = None
    stop_token_ids: Annotated[list[Annotated[int, Field(strict=True)]] | None, Field(
        description="a list of at most 1024 token ids in [0, {vocab_size})")] = None
    logprobs: _switch() = None
    top_logprobs: _neutral(0) = None
    return_token_ids: _switch() = None
    stream: _switch("false (streaming is not supported)") = None
    tool_choice: Annotated[Literal["auto", "none"] | None, Field(
        description="'auto' or 'none' (a forced tool choice is not supported)")] = None
    parallel_tool_calls: _switch() = None
    frequency_penalty: _neutral(0.0) = None
    presence_penalty: _neutral(0.0) = None
    user: Annotated[StrictStr | None, Field(description="a string")] = None
    session_id: Annotated[StrictStr | None, Field(
        min_length=1, max_length=256, description="a string of 1-256 characters naming the episode these calls "
                                                  "belong to (k3core/rollout/chat_sessions.py)")] = None

    @field_validator("stop_token_ids")
    @classmethod
    def _in_the_vocabulary(cls, v, info):
        vocab = (info.context or {}).get("vocab_size", 1 << 31)
        if v is not None and (len(v) > 1024 or not all(0 <= t < vocab for t in v)):
            raise ValueError("out of range")
        return v

    @model_validator(mode="after")
    def _supported(self):
        if self.stream:
            raise ValueError("streaming is not supported: send stream=false")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("'max_tokens' and 'max_completion_tokens' differ: send one of them")
        return self

    def template_inputs(self) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) as plain dicts for the chat template (no nulls, as OpenAI clients send them)."""
        messages = [m.model_dump(exclude_none=True) for m in self.messages]
        tools = None if not self.tools or self.tool_choice == "none" else [
            t.model_dump(exclude_none=True) for t in self.tools]
        return messages, tools


register_nested(ChatRequest, "messages", ChatMessage)
register_nested(ChatRequest, "tools", ToolDeclaration)


def chat_prompt(req: ChatRequest, tokenizer) -> list[int]:
    """The request rendered in ``tokenizer``'s chat template with the assistant's generation prompt."""
    from k3core.tokenizer import ChatTemplateError

    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest("this server's checkpoint has no chat template (its tokenizer_config.json has no "
                         "'chat_template' and there is no chat_template.jinja): use /generate with input_ids or text")
    messages, tools = req.template_inputs()
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    except (ChatTemplateError, ValueError, TypeError) as e:
        raise BadRequest(f"the chat template cannot render these messages: {e}") from None


def chat_sampling(req: ChatRequest, tokenizer, cap: int, vocab_size: int):
    """(engine SamplingParams, stop strings): OpenAI's defaults (temperature 1, one choice), stopping at
    the tokenizer's end-of-turn ids, the request's ``stop_token_ids`` and ``stop`` strings."""
    from k3core.rollout.engine import SamplingParams

    max_new = req.max_completion_tokens or req.max_tokens or min(128, cap)
    if max_new > cap:
        raise BadRequest(f"'max_tokens' must be at most {cap} (this server's --max-new-tokens-cap), got {max_new}")
    top_k = 0 if req.top_k in (None, -1, 0) or req.top_k >= vocab_size else req.top_k
    stop_ids = tuple(dict.fromkeys([*tokenizer.stop_ids, *(req.stop_token_ids or [])]))
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, stop_token_ids=stop_ids,
                            n=req.n or 1, seed=req.seed)
    try:
        params.validate()
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return params, [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def ended_by_id(c) -> bool:
    """Whether completion ``c`` ended at a stop id (its last id), not a stop string or a length cap."""
    matched = c.meta.get("matched")
    return c.finish_reason == "stop" and isinstance(matched, int) and bool(c.output_ids) and c.output_ids[-1] == matched


def _choice(index: int, c, tokenizer, req: ChatRequest) -> dict:
    from k3core.tokenizer.tool_calls import parse_assistant_text

    ids, matched = list(c.output_ids), c.meta.get("matched")
    text = tokenizer.decode(ids[:-1] if ended_by_id(c) else ids)  # the end-of-turn token is not content
    if c.finish_reason == "stop" and isinstance(matched, str) and matched in text:
        text = text[:text.find(matched)]
    parsed = parse_assistant_text(text) if req.tools and req.tool_choice != "none" else None
    message: dict[str, Any] = {"role": "assistant", "content": text if parsed is None else parsed.content}
    finish = {"stop": "stop", "length": "length", "abort": "abort"}.get(c.finish_reason, c.finish_reason)
    if parsed is not None and parsed.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        finish = "tool_calls" if finish == "stop" else finish
    choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if parsed is not None and parsed.errors:
        choice["tool_call_errors"] = parsed.errors
    if req.logprobs:
        choice["logprobs"] = {"content": [
            {"token": tokenizer.decode([t]), "logprob": lp, "bytes": list(tokenizer.decode([t]).encode("utf-8")),
             "top_logprobs": []} for t, lp in zip(ids, c.logprobs)]}
    if req.return_token_ids:
        choice["token_ids"] = ids
    return choice


def chat_response(comps, tokenizer, req: ChatRequest, prompt_ids: list[int], rid: str, model: str | None) -> dict:
    """OpenAI's ``chat.completion`` object for the engine's completions ``comps`` of one prompt,
    plus the weight version that sampled them (``weight_version``)."""
    completion_tokens = sum(len(c.output_ids) for c in comps)
    out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
           "model": req.model or model or "k3", "choices": [_choice(i, c, tokenizer, req) for i, c in enumerate(comps)],
           "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                     "total_tokens": len(prompt_ids) + completion_tokens},
           "weight_version": comps[0].weight_version if comps else None}
    if req.return_token_ids:
        out["prompt_token_ids"] = list(prompt_ids)
    return out
