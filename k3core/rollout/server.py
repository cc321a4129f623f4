"""The rollout engine behind HTTP: the part of SGLang's native API that RL uses, same paths and fields.

  POST /generate                   ``input_ids`` (list or list of lists) or ``text`` (str or list),
                                   ``sampling_params`` {max_new_tokens, temperature, top_p, top_k, stop,
                                   stop_token_ids, n, seed | sampling_seed, ignore_eos, no_stop_trim, ...},
                                   ``return_logprob``, ``return_routed_experts``
                                   -> {text, output_ids, meta_info {id, finish_reason, prompt_tokens,
                                   completion_tokens, cached_tokens, weight_version, e2e_latency,
                                   output_token_logprobs [[logprob, token id, null], ...],
                                   routed_experts (base64 little-endian int32
                                   [prompt + completion - 1, n_moe_layers, k])}}; a single prompt with n = 1
                                   answers one object, anything else a list ordered (prompt, sample)
  POST /v1/chat/completions        OpenAI's chat completions: ``messages`` and ``tools`` rendered in the
                                   checkpoint's chat template, ``tool_calls`` parsed from the answer,
                                   ``logprobs``, ``return_token_ids`` (``chat_completions.py``); with
                                   ``session_id`` the calls of one episode record one trajectory
  GET|DELETE /v1/sessions/{id}     a chat session's trajectory (ids, loss mask, logprobs, weight
                                   versions, calls), or free it (``chat_sessions.py``)
  POST /release_sessions           {session_ids}: free the decode state kept for these ``/generate``
                                   sessions (``RolloutEngine`` sessions) -> {freed_bytes}
  POST /update_weights_from_disk   {model_path (our public HF layout), weight_version} -> {success, message,
                                   num_paused_requests}; 400 and the old version keeps serving on failure.
                                   A directory from ``k3core.transfer.write_disk`` is digest-checked and
                                   its declared version used when the request names none. The new
                                   weights are read into host memory first (one full copy beside the
                                   engine's), then swapped between requests
  POST /update_weights_from_tensor a transfer payload of ``k3core.transfer`` (``send_shm_stream`` /
                                   ``send_cuda_ipc``; not SGLang's serialized tensors): ``load_payload``
                                   verifies digests, names, shapes, dtypes and that the version is newer
                                   -> same answer as from disk. A streamed payload is pulled through the
                                   sender's ring of buckets into a staged host copy while the request is
                                   open, loaded only once all of it is verified; CUDA IPC buckets are
                                   read in place, in the sender's GPU memory
  GET  /health                     200 while the decode thread runs, 503 otherwise
  GET  /get_model_info             {model_path, weight_version, is_generation, architectures, ..., load}

Owns: HTTP parsing and validation (the request models ``GenerateRequest``, ``SamplingRequest`` and
``DiskUpdateRequest``, checked by pydantic; 400 naming each refused field, what it may hold and what
came: every number typed and in range, NaN and inf refused), the limits of ``ServerLimits`` (request body -> 413, prompt tokens, ``max_new_tokens``
and ``top_k`` caps -> 400, requests in flight -> 503 with ``Retry-After``), the API key (``api_key``:
every endpoint but ``/health`` needs ``Authorization: Bearer <key>``, else 401), where disk weight
updates may come from (``ServerLimits.weight_roots``, else 403) and that versions only move forward
(an older ``weight_version`` is refused; the engine refuses non-finite weights), cancelling a
request's generation when its client disconnects (its sequences end at the next decode step, finish
reason ``abort``), stop strings (a ``stop_checker`` built from
the tokenizer: the engine is token-only; the matched string ends the output and is trimmed from
``text`` unless ``no_stop_trim``), overload (the engine's bounded queue -> 503 with a clear message
and ``Retry-After``), and the end-of-sequence default of SGLang (stop at the tokenizer's eos unless
``ignore_eos``). Does not own: batching, sampling, versions (``engine.py``); weight files
(``k3core.checkpoint``); transfer manifests (``k3core.transfer``).

Decoding runs on the engine's one background thread; handlers only enqueue and await its futures, and
weight loads run in a worker thread, so ``/generate`` keeps answering during an update (requests
queued meanwhile wait for the swap; requests in flight finish on the old version and say so).
Authentication is the API key only (no TLS: put a TLS proxy in front on an untrusted network);
``k3rl rollout-server`` refuses a non-loopback address without one. The command line
that serves a checkpoint is ``k3rl rollout-server`` (``flows/cli_serve.py``); engines and weight
updates from checkpoints are ``checkpoints.py``.
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' annotations (``Request``,
# imported inside ``create_app``) as objects, not as strings to resolve in this module's globals

import asyncio
import base64
import hmac
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool, StrictInt,
                      StrictStr, Tag, ValidationError, ValidationInfo, field_validator, model_validator)

from k3core.rollout.checkpoints import checkpoint_state_for
from k3core.rollout.request_fields import (_NESTED, TOP_K_ALL, BadRequest, _float, _Ids, _int, _integral,  # noqa: F401
                                           _neutral, _StopString, _switch, register_nested)

if TYPE_CHECKING:  # torch and fastapi are imported where used: importing this module stays light
    from k3core.rollout.engine import RolloutEngine

__all__ = ["DEFAULT_PORT", "BadRequest", "ServerLimits", "GenerateRequest", "SamplingRequest", "DiskUpdateRequest",
           "create_app", "stop_string_checker", "tokenizer_for", "is_loopback"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 30000  # SGLang's default

@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server; each refusal names the limit and the flag that sets it.

    ``max_body_bytes``: a larger ``/generate`` body is refused (413) before it is parsed (``--max-body-bytes``).
    ``max_update_body_bytes``: the same for weight updates, whose transfer payloads list every tensor
    (``--max-update-body-bytes``).
    ``max_prompt_tokens``: per prompt, after tokenising (``--max-prompt-tokens``).
    ``max_new_tokens``: the cap on ``sampling_params.max_new_tokens`` (``--max-new-tokens-cap``).
    ``max_concurrent_requests``: ``/generate`` requests in flight; one more answers 503 with
    ``Retry-After`` (``--max-concurrent-requests``).
    ``max_chat_sessions``: chat sessions (trajectories) held; past it the least recently used is
    dropped (``--max-chat-sessions``).
    ``weight_roots``: directories ``/update_weights_from_disk`` may read under (symlinks resolved);
    a path elsewhere is refused with 403 (``--weight-root``). None: anywhere (library use; the
    command line always sets them).
    ``allow_version_rollback``: accept a disk update older than the served version (a server reused
    by a new run that starts again at 0; ``--allow-version-rollback``). Off: versions only move
    forward, so a late or replayed push cannot roll the weights back.
    ``body_timeout_s``: a request whose whole body has not arrived within it answers 408 and frees
    its slot (``--body-timeout``): slow-body clients cannot hold every request slot."""
    max_body_bytes: int = 16 << 20
    max_update_body_bytes: int = 256 << 20
    max_prompt_tokens: int = 16384
    max_new_tokens: int = 4096
    max_concurrent_requests: int = 512
    max_chat_sessions: int = 4096
    weight_roots: tuple[str, ...] | None = None
    allow_version_rollback: bool = False
    body_timeout_s: float = 30.0

    def __post_init__(self):
        bad = [f"{k} must be >= 1, got {getattr(self, k)}" for k in
               ("max_body_bytes", "max_update_body_bytes", "max_prompt_tokens", "max_new_tokens", "max_concurrent_requests",
                "max_chat_sessions")
               if not isinstance(getattr(self, k), int) or getattr(self, k) < 1]
        if not (isinstance(self.body_timeout_s, (int, float)) and 0 < self.body_timeout_s < float("inf")):
            bad.append(f"body_timeout_s must be a positive number of seconds, got {self.body_timeout_s}")
        if bad:
            raise ValueError("invalid server limits: " + "; ".join(bad))

    def allowed_weight_path(self, path: str) -> Path:
        """``path`` resolved, when it lies under a weight root; BadRequest 403 otherwise."""
        if "\0" in path:
            raise BadRequest("'model_path' contains a NUL byte")
        real = Path(os.path.realpath(path))
        if self.weight_roots is None:
            return real
        roots = [Path(os.path.realpath(r)) for r in self.weight_roots]
        if any(real == r or r in real.parents for r in roots):
            return real
        raise BadRequest(f"model_path {path} is outside the directories this server takes weights from "
                         f"({', '.join(map(str, roots)) or 'none'}): start it with --weight-root DIR", status=403)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server off the network."""
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------ request models

class SamplingRequest(BaseModel):
    """SGLang's ``sampling_params`` as this server takes them (unknown keys refused)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Annotated[Annotated[int, BeforeValidator(_integral), Field(strict=True)] | None, Field(
        description="an integer in [1, {max_new_tokens}] (this server's --max-new-tokens-cap)")] = None
    temperature: _float(0.0, 1e4) = None
    top_p: _float(0.0, 1.0, lo_open=True) = None
    top_k: _int(-1, TOP_K_ALL, " (-1 or 0: off)") = None
    stop: Annotated[_StopString | Annotated[list[_StopString], Field(max_length=64)] | None, Field(
        description="a non-empty string or a list of at most 64 of them, each at most 1024 characters")] = None
    stop_token_ids: Annotated[list[Annotated[int, Field(strict=True)]] | None, Field(
        description="a list of at most 1024 token ids in [0, {vocab_size})")] = None
    n: _int(1, 1 << 20) = None
    seed: _int(0, (1 << 63) - 1) = None
    sampling_seed: _int(0, (1 << 63) - 1) = None
    ignore_eos: _switch() = None
    no_stop_trim: _switch() = None
    # SGLang fields that change nothing here (detokenisation details, defaults we already follow)
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    stream_interval: Any = None
    min_p: _neutral(0.0) = None
    frequency_penalty: _neutral(0.0) = None
    presence_penalty: _neutral(0.0) = None
    repetition_penalty: _neutral(1.0) = None
    min_new_tokens: _neutral(0) = None

    @field_validator("max_new_tokens")
    @classmethod
    def _under_the_cap(cls, v, info: ValidationInfo):
        if v is not None and not 1 <= v <= (info.context or {}).get("max_new_tokens", 1 << 31):
            raise ValueError("out of range")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _in_the_vocabulary(cls, v, info: ValidationInfo):
        vocab = (info.context or {}).get("vocab_size", 1 << 31)
        if v is not None and (len(v) > 1024 or not all(0 <= t < vocab for t in v)):
            raise ValueError("out of range")
        return v


_SAMPLING_USED = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "n", "seed",
                  "sampling_seed", "ignore_eos", "no_stop_trim")


def _one_or_list(v) -> str:
    return "list" if isinstance(v, list) else "one"


class GenerateRequest(BaseModel):
    """The body of ``/generate`` (unknown fields refused)."""

    model_config = ConfigDict(extra="forbid")

    input_ids: Annotated[_Ids | Annotated[list[_Ids], Field(min_length=1)] | None, Field(
        description="a non-empty list of token ids or a list of such lists")] = None
    text: Annotated[Annotated[str, Field(strict=True)] | Annotated[list[Annotated[str, Field(strict=True)]],
                                                                   Field(min_length=1)] | None,
                    Field(description="a string or a non-empty list of strings")] = None
    sampling_params: Annotated[Annotated[Annotated[SamplingRequest, Tag("one")]
                                         | Annotated[list[SamplingRequest], Tag("list")],
                                         Discriminator(_one_or_list)] | None,
                               Field(description="an object, or a list of them (one per prompt)")] = None
    return_logprob: _switch() = None
    return_routed_experts: _switch() = None
    stream: _switch() = None
    return_text_in_logprobs: _switch() = None
    rid: Annotated[StrictStr | None, Field(description="a string")] = None
    session_id: Annotated[StrictStr | None, Field(
        max_length=256, description="a string: the episode whose decode state this turn continues and keeps "
                                    "(one prompt, n = 1)")] = None
    logprob_start_len: Any = None
    top_logprobs_num: Any = None

    @model_validator(mode="after")
    def _one_prompt_source(self):
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of 'input_ids' (token ids) and 'text'")
        if self.stream:
            raise ValueError("streaming is not supported: send stream=false")
        if self.top_logprobs_num:
            raise ValueError("top_logprobs_num is not supported (output_token_logprobs only)")
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != self.num_prompts:
            raise ValueError(f"{len(self.sampling_params)} sampling_params for {self.num_prompts} prompts")
        if self.session_id is not None and (self.batch or (self.sampling_params is not None and not isinstance(
                self.sampling_params, list) and (self.sampling_params.n or 1) != 1)):
            raise ValueError("a session_id names one trajectory: send one prompt with n = 1")
        return self

    @property
    def batch(self) -> bool:
        """Whether the request was a batch (a list of prompts): the answer is a list then."""
        ids = self.input_ids
        return isinstance(self.text, list) or (ids is not None and isinstance(ids[0], list))

    @property
    def num_prompts(self) -> int:
        return len(self.text if self.text is not None else self.input_ids) if self.batch else 1


def _only_false(v):
    if v:
        raise ValueError("unsupported value")
    return v


class DiskUpdateRequest(BaseModel):
    """The body of ``/update_weights_from_disk`` (SGLang's other fields are ignored)."""

    model_path: Annotated[StrictStr, Field(min_length=1, description="a string: the path of a checkpoint directory "
                                                                    "in the public layout")]
    weight_version: Annotated[StrictInt | None, Field(ge=0, description="a non-negative integer (a JSON number): "
                                                                       "versions are ordered, a string is not")] = None
    load_format: Annotated[Literal["auto", "safetensors"] | None, Field(description="'auto' or 'safetensors'")] = None
    abort_all_requests: Annotated[StrictBool | None, AfterValidator(_only_false), Field(
        description="false (requests in flight finish on the old version)")] = None


def _field_path(model: type[BaseModel], loc: tuple) -> tuple[tuple, type[BaseModel] | None, str | None]:
    """(the part of ``loc`` that names a field, the model declaring that field, its name): union
    branch labels pydantic puts in ``loc`` are skipped, and so are list indices below a field (the
    whole field's value is shown), except those of a list of models (``sampling_params[1].n``)."""
    path, owner, name, current = [], None, None, model
    for part in loc:
        if isinstance(part, int):
            if current is not None and path:
                path.append(part)
        elif current is not None and part in current.model_fields:
            path.append(part)
            owner, name = current, part
            current = _NESTED.get((owner, part))
    return tuple(path), owner, name


def _shown(path: tuple) -> str:
    if len(path) == 1:
        return f"'{path[0]}'"
    return "".join(f"[{p}]" if isinstance(p, int) else (p if i == 0 else f".{p}") for i, p in enumerate(path))


def _value_at(body, path: tuple):
    for p in path:
        try:
            body = body[p]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def _refusal(model: type[BaseModel], body: dict, e: ValidationError, context: dict) -> str:
    """One sentence per refused field (field, what is allowed, what came), in the body's order."""
    out, extra = [], {}
    for err in e.errors(include_url=False):
        path, owner, name = _field_path(model, err["loc"])
        if err["type"] == "extra_forbidden":
            extra.setdefault(path, []).append(err["loc"][-1])
            continue
        if name is None:  # a rule over the whole body
            msg = str(err.get("ctx", {}).get("error", err["msg"]))
        elif err["type"] == "value_error" and isinstance(path[-1], int):  # a rule over one item of a list
            msg = f"{_shown(path)}: {err.get('ctx', {}).get('error', err['msg'])}"
        else:
            allowed = (owner.model_fields[name].description or "").format(**context)
            msg = (f"{_shown(path)} ({allowed}) is required" if err["type"] == "missing"
                   else f"{_shown(path)} must be {allowed}, got {_value_at(body, path)!r}"[:400])
        if msg not in out:
            out.append(msg)
    for where, names in extra.items():
        if where:
            out.append(f"unsupported {_shown(where).strip(chr(39))} {sorted(names)}; supported: {sorted(_SAMPLING_USED)}")
        else:
            out.append(f"unsupported fields {sorted(names)}")
    return "; ".join(out)


register_nested(GenerateRequest, "sampling_params", SamplingRequest)


def _parse(model: type[BaseModel], body: dict, context: dict):
    """``body`` as ``model``, or BadRequest (400) saying what is wrong with it."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as e:
        raise BadRequest(_refusal(model, body, e, context)) from None


def _prompts(req: GenerateRequest, tokenizer) -> list[list[int]]:
    """The request's prompts as token ids."""
    if req.text is not None:
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer on the server: send 'input_ids'")
        return [tokenizer.encode(t) for t in (req.text if req.batch else [req.text])]
    return req.input_ids if req.batch else [req.input_ids]


def _sampling(sp: SamplingRequest | None, eos_ids: tuple[int, ...], cap: int,
              vocab_size: int | None = None) -> tuple[Any, list[str], bool]:
    """Validated ``sampling_params`` -> (engine SamplingParams, stop strings, no_stop_trim), with
    SGLang's defaults: stop at the end-of-sequence ids (the tokenizer's eos and end-of-turn ids, as
    SGLang reads them from the generation config) unless ``ignore_eos``."""
    from k3core.rollout.engine import SamplingParams

    sp = sp or SamplingRequest()
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    stop_ids = list(sp.stop_token_ids or [])
    if not sp.ignore_eos:
        stop_ids += list(eos_ids)
    top_k = -1 if sp.top_k is None else sp.top_k
    if top_k in (-1, 0) or (vocab_size is not None and top_k >= vocab_size):
        top_k = 0  # off: keeping every token of the vocabulary is no filter
    try:
        params = SamplingParams(
            max_new_tokens=sp.max_new_tokens if sp.max_new_tokens is not None else min(128, cap),
            temperature=1.0 if sp.temperature is None else sp.temperature,
            top_p=1.0 if sp.top_p is None else sp.top_p, top_k=top_k, stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            n=sp.n or 1, seed=sp.seed if sp.seed is not None else sp.sampling_seed)
        params.validate()
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from e
    return params, stop, bool(sp.no_stop_trim)


def stop_string_checker(tokenizer, stops: list[str]):
    """output ids -> the first stop string found in their decoded text, or None."""
    def check(ids: list[int]) -> str | None:
        text = tokenizer.decode(ids)
        hits = [(text.find(s), s) for s in stops if s in text]
        return min(hits)[1] if hits else None

    return check


def _output(c, tokenizer, no_stop_trim: bool, return_logprob: bool, return_routing: bool, rid: str,
            t0: float) -> dict:
    if c.finish_reason == "length":
        finish = {"type": "length", "length": c.meta.get("matched")}
    elif c.finish_reason == "abort":
        finish = {"type": "abort", "message": c.meta.get("matched")}
    else:
        finish = {"type": "stop", "matched": c.meta.get("matched")}
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(c.prompt_ids),
            "completion_tokens": len(c.output_ids), "cached_tokens": 0, "weight_version": c.weight_version,
            "e2e_latency": time.perf_counter() - t0}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.logprobs, c.output_ids)]
    if return_routing:  # SGLang's encoding: base64 of little-endian int32, [positions, layers, k]
        meta["routed_experts"] = base64.b64encode(c.routing.numpy().astype("<i4").tobytes()).decode("ascii")
    out = {"output_ids": c.output_ids, "meta_info": meta}
    if tokenizer is not None:
        text = tokenizer.decode(c.output_ids)
        if isinstance(finish.get("matched"), str) and not no_stop_trim and finish["type"] == "stop":
            text = text[:text.find(finish["matched"])]
        out = {"text": text, **out}
    return out


# ------------------------------------------------------------------ the app
class _Cancelled(Exception):
    """Raised by a request's stop checker once its client has gone: the engine ends the sequence."""


def _cancellable(checker, cancel: threading.Event):
    """A stop checker that ends the sequence (finish reason ``abort``) once ``cancel`` is set."""
    def check(ids: list[int]):
        if cancel.is_set():
            raise _Cancelled("the client disconnected")
        return checker(ids) if checker is not None else None

    return check


class _RequireApiKey:
    """Plain ASGI middleware: every HTTP path but ``/health`` needs ``Authorization: Bearer <key>``
    (compared in constant time). Plain ASGI, so the handlers still see the client's disconnect."""

    def __init__(self, app, want: bytes):
        self.app, self.want = app, want

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self.want):
                from fastapi.responses import JSONResponse

                msg = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                await JSONResponse({"error": {"message": msg, "code": 401}}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: "RolloutEngine", tokenizer=None, model_path: str | None = None, *,
               limits: ServerLimits | None = None, api_key: str | None = None):
    """The FastAPI app over ``engine``. Its lifespan starts the engine's decode thread and stops it.
    ``limits``: ``ServerLimits`` (default: its defaults, weights from anywhere). ``api_key``: when
    set, every endpoint but ``/health`` requires ``Authorization: Bearer <api_key>``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect

    from k3core.rollout.engine import EngineOverloaded, EngineStopped

    state = {"model_path": model_path, "in_flight": 0}
    disk_updates = threading.Lock()  # the version check and the swap as one step: two pushes cannot cross
    limits = limits or ServerLimits()
    vocab = engine.config.vocab_size
    context = {"max_new_tokens": limits.max_new_tokens, "vocab_size": vocab}  # the limits the request models name

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="k3rl rollout engine", lifespan=lifespan)

    def error(status: int, message: str, **headers) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status, headers=headers or None)

    if api_key:
        app.add_middleware(_RequireApiKey, want=f"Bearer {api_key}".encode())

    async def body_of(request: Request, update: bool = False) -> dict:
        limit, flag = ((limits.max_update_body_bytes, "--max-update-body-bytes") if update
                       else (limits.max_body_bytes, "--max-body-bytes"))
        too_big = BadRequest(f"request body larger than {limit} bytes ({flag})", status=413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, n = [], 0
        try:
            async with asyncio.timeout(limits.body_timeout_s):  # a client sending nothing holds no slot for ever
                async for chunk in request.stream():
                    n += len(chunk)
                    if n > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise BadRequest(f"the request body did not arrive within {limits.body_timeout_s:g} s (--body-timeout)",
                             status=408) from None
        except ClientDisconnect:
            log.warning("a client disconnected before its request body was read (%s %s)", request.method, request.url.path)
            raise BadRequest("the client disconnected before its body was read") from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not JSON ({e})") from e
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    async def counted(handler, request: Request):
        """``handler(request)`` as one of the requests in flight (503 past the limit)."""
        if state["in_flight"] >= limits.max_concurrent_requests:
            return error(503, f"server busy: {state['in_flight']} requests in flight, the limit is "
                              f"{limits.max_concurrent_requests} (--max-concurrent-requests); retry later",
                         **{"Retry-After": "1"})
        state["in_flight"] += 1
        try:
            return await handler(request)
        finally:
            state["in_flight"] -= 1

    def refusal(e: Exception) -> JSONResponse:
        """The answer to a request refused before it queued: bad input 4xx, an overloaded or stopped engine 503."""
        if isinstance(e, BadRequest):
            return error(e.status, str(e))
        if isinstance(e, EngineOverloaded):
            return error(503, str(e), **{"Retry-After": "1"})
        return error(503 if isinstance(e, EngineStopped) else 400, str(e))

    async def completions_of(request: Request, futures, cancel: threading.Event, what: str):
        """(the engine's completions of ``futures``, None), or (None, the answer) when the client left
        (499; its sequences end at the next decode step) or generation failed."""
        gathered = asyncio.ensure_future(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even when abandoned
        while not gathered.done():
            await asyncio.wait({gathered}, timeout=0.25)
            if not gathered.done() and await request.is_disconnected():
                cancel.set()  # nobody reads the answer
                log.info(f"client of a {what} request disconnected: generation cancelled")
                return None, Response(status_code=499)
        try:
            return gathered.result(), None
        except EngineStopped as e:
            return None, error(503, str(e))
        except Exception as e:
            log.exception("generation failed")
            return None, error(500, f"generation failed: {type(e).__name__}: {e}")

    from k3core.rollout.chat_sessions import ChatSessions

    chat_sessions = ChatSessions(limits.max_chat_sessions)

    def submit(reqs: list, cancel: threading.Event, sessions: list | None = None):
        """Queue (prompt ids, params, stop strings) requests on the engine, each cancellable."""
        for i, (p, _, stops) in enumerate(reqs):
            if len(p) > limits.max_prompt_tokens:
                raise BadRequest(f"prompt {i} has {len(p)} tokens, the limit is {limits.max_prompt_tokens} "
                                 f"(--max-prompt-tokens)")
            if stops and tokenizer is None:
                raise BadRequest("stop strings need a tokenizer and this server has none for this model: "
                                 "use stop_token_ids")
        total = sum(params.n for _, params, _ in reqs)
        if total > engine.max_queue:
            raise EngineOverloaded(f"rollout engine overloaded: this request's {total} sequences exceed the "
                                   f"queue limit {engine.max_queue} (--max-queue); send fewer")
        return engine.submit_many([(p, params, _cancellable(stop_string_checker(tokenizer, stops) if stops else None,
                                                            cancel)) for p, params, stops in reqs], sessions=sessions)

    @app.post("/generate")
    async def generate(request: Request):
        return await counted(_generate, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await counted(_chat, request)

    async def _chat(request: Request):
        from k3core.rollout.chat_completions import ChatRequest, chat_prompt, chat_response, chat_sampling, ended_by_id

        cancel = threading.Event()
        session = None
        try:
            req = _parse(ChatRequest, await body_of(request), context)
            params, stops = chat_sampling(req, tokenizer, limits.max_new_tokens, vocab)
            if req.session_id is None:
                prompt, n_new = chat_prompt(req, tokenizer), 0
            else:
                if params.n != 1:
                    raise BadRequest("a session_id names one trajectory: send n = 1")
                messages, tools = req.template_inputs()
                session, prompt, n_new = chat_sessions.begin(req.session_id, messages, tools, tokenizer,
                                                             lambda: chat_prompt(req, tokenizer))
            keys = None if session is None else [chat_sessions.engine_key(session.id)]
            futures = submit([(prompt, params, stops)], cancel, keys)
        except (ValueError, EngineOverloaded, EngineStopped) as e:
            if session is not None:
                chat_sessions.release(session)
            return refusal(e)
        results, refused = await completions_of(request, futures, cancel, "/v1/chat/completions")
        if refused is not None:
            if session is not None:
                chat_sessions.release(session)
            return refused
        out = chat_response(results[0], tokenizer, req, prompt, uuid.uuid4().hex,
                            Path(state["model_path"]).name if state["model_path"] else None)
        if session is not None:
            c = results[0][0]
            messages, tools = req.template_inputs()
            chat_sessions.finish(session, prompt, n_new, c, messages, out["choices"][0]["message"], tokenizer, tools,
                                 ended_by_id(c), params.temperature)
            out["session_id"] = session.id
            engine.release_sessions([chat_sessions.engine_key(x) for x in chat_sessions.take_dropped()])
        return JSONResponse(out)

    @app.get("/v1/sessions/{sid}")
    async def get_session(sid: str):
        s = chat_sessions.get(sid)
        if s is None:
            return error(404, f"no chat session {sid!r} (never started, deleted, or dropped as the least recently "
                              f"used past --max-chat-sessions)")
        return JSONResponse(s.as_dict())

    @app.delete("/v1/sessions/{sid}")
    async def delete_session(sid: str):
        s = chat_sessions.pop(sid)
        freed = engine.release_sessions([chat_sessions.engine_key(sid)])
        if s is None:
            return error(404, f"no chat session {sid!r}")
        return JSONResponse({"session_id": sid, "deleted": True, "freed_bytes": freed})

    @app.post("/release_sessions")
    async def release_sessions(request: Request):
        try:
            body = await body_of(request)
            ids = body.get("session_ids")
            if not isinstance(ids, list) or not all(isinstance(x, str) for x in ids) or len(ids) > 65536:
                raise BadRequest("'session_ids' must be a list of at most 65536 strings")
        except BadRequest as e:
            return error(e.status, str(e))
        return JSONResponse({"freed_bytes": engine.release_sessions(ids)})

    async def _generate(request: Request):
        t0 = time.perf_counter()
        cancel = threading.Event()
        try:
            req = _parse(GenerateRequest, await body_of(request), context)
            prompts = _prompts(req, tokenizer)
            sps = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * len(prompts)
            eos = tuple(tokenizer.stop_ids) if tokenizer is not None else (engine.config.eos_token_id,)
            parsed = [_sampling(sp, eos, limits.max_new_tokens, vocab) for sp in sps]
            futures = submit([(p, params, stops) for p, (params, stops, _) in zip(prompts, parsed)], cancel,
                             None if req.session_id is None else [req.session_id])
        except (ValueError, EngineOverloaded, EngineStopped) as e:
            return refusal(e)
        results, refused = await completions_of(request, futures, cancel, "/generate")
        if refused is not None:
            return refused
        rid = req.rid or uuid.uuid4().hex
        outs = [_output(c, tokenizer, nst, bool(req.return_logprob), bool(req.return_routed_experts),
                        f"{rid}-{i}-{c.sample_index}", t0)
                for i, (comps, (_, _, nst)) in enumerate(zip(results, parsed)) for c in comps]
        return JSONResponse(outs if req.batch or len(outs) > 1 else outs[0])

    async def _update(load, version, what: str):
        paused = engine.load()["waiting"]
        try:
            await asyncio.to_thread(load)
        except Exception as e:  # refused: the old version keeps serving
            log.warning("weight update from %s refused: %s", what, e)
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}",
                                 "num_paused_requests": paused, "weight_version": engine.weight_version}, status_code=400)
        return JSONResponse({"success": True, "message": f"weights from {what} serving as version {engine.weight_version}",
                             "num_paused_requests": paused, "weight_version": engine.weight_version})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        try:
            req = _parse(DiskUpdateRequest, await body_of(request, update=True), context)
            path = req.model_path
            version = _version(req.weight_version, engine.weight_version)
            real = limits.allowed_weight_path(path)
        except BadRequest as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=e.status)

        def load():
            with disk_updates:
                sd, declared = checkpoint_state_for(engine, real)
                if declared is not None and req.weight_version is not None and not _same(declared, version):
                    raise ValueError(f"{path} declares weight version {declared}, the request says {version}")
                new = declared if declared is not None and req.weight_version is None else version
                if not limits.allow_version_rollback:
                    _check_not_older(new, engine.weight_version)
                engine.load_weights(sd, new)
                state["model_path"] = path

        return await _update(load, version, path)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        try:
            body = await body_of(request, update=True)
        except BadRequest as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=e.status)

        def load():
            from k3core.transfer import load_payload  # verify against the engine, then load_weights

            load_payload(engine, body)

        return await _update(load, None, "a transfer payload")

    @app.get("/health")
    async def health():
        if not engine.is_serving:
            return error(503, "the decode thread is not running")
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        from k3core.rollout.quantized import expert_format

        cfg = engine.config
        return {"model_path": state["model_path"], "tokenizer_path": None, "is_generation": True,
                "weight_version": engine.weight_version, "model_type": "kimi_k3",
                "architectures": ["KimiK3ForConditionalGeneration"], "vocab_size": cfg.vocab_size,
                "eos_token_id": cfg.eos_token_id, "num_moe_layers": len(engine.model.moe_layer_ids),
                "num_experts_per_token": cfg.num_experts_per_token, "expert_format": expert_format(engine.model),
                "dtype": str(engine.model.lm_head.weight.dtype).removeprefix("torch."),
                "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None, "load": engine.load(),
                "sessions": {**engine.kept_sessions(), **{k: engine.stats[k] for k in (
                    "session_hits", "session_misses", "session_evictions", "reused_tokens")}}}

    return app


def _same(a, b) -> bool:
    return str(a) == str(b)


def _check_not_older(new, current) -> None:
    """Versions only move forward (the same one again is a retry): an older integer version is refused."""
    if isinstance(new, int) and isinstance(current, int) and new < current:
        raise ValueError(f"weight version {new} is older than the served {current}: refused (versions only move "
                         f"forward; a server reused by a new run needs --allow-version-rollback)")


def _version(v: int | None, current):
    """A request's weight_version (a non-negative integer, checked by ``DiskUpdateRequest``), default the
    current one + 1."""
    if v is None:
        if isinstance(current, int):
            return current + 1
        raise BadRequest("'weight_version' is required (the current one is not a number)")
    return v


def tokenizer_for(config, checkpoint: str | None = None):
    """The tokenizer of the served checkpoint directory (its data files, ``k3core.tokenizer.load_tokenizer``;
    never its code), the byte tokenizer where the vocabulary is one and there are no files, else None
    (requests then give ``input_ids``)."""
    from k3core.tokenizer import ByteTokenizer, load_tokenizer

    try:
        return load_tokenizer(checkpoint, config) if checkpoint is not None else ByteTokenizer(config)
    except ValueError:
        return None
