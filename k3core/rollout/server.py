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
  POST /update_weights_from_disk   {model_path (our public HF layout), weight_version} -> {success, message,
                                   num_paused_requests}; 400 and the old version keeps serving on failure.
                                   A directory from ``k3core.transfer.write_disk`` is digest-checked and
                                   its declared version used when the request names none. The new
                                   weights are read into host memory first (one full copy beside the
                                   engine's), then swapped between requests
  POST /update_weights_from_tensor a transfer payload of ``k3core.transfer`` (``send_shm`` /
                                   ``send_cuda_ipc`` / ``send_shm_stream``; not SGLang's serialized
                                   tensors): ``load_payload`` verifies digests, names, shapes, dtypes and
                                   that the version is newer -> same answer as from disk. ``shm`` bytes
                                   stay in the sender's shared memory; a streamed payload is pulled
                                   through the sender's ring of buckets into a staged host copy while
                                   the request is open, loaded only once all of it is verified
  GET  /health                     200 while the decode thread runs, 503 otherwise
  GET  /get_model_info             {model_path, weight_version, is_generation, architectures, ..., load}

Owns: HTTP parsing and validation (400 with the reason), stop strings (a ``stop_checker`` built from
the tokenizer: the engine is token-only; the matched string ends the output and is trimmed from
``text`` unless ``no_stop_trim``), overload (the engine's bounded queue -> 503 with a clear message
and ``Retry-After``), and the end-of-sequence default of SGLang (stop at the tokenizer's eos unless
``ignore_eos``). Does not own: batching, sampling, versions (``engine.py``); weight files
(``k3core.checkpoint``); transfer manifests (``k3core.transfer``).

Decoding runs on the engine's one background thread; handlers only enqueue and await its futures, and
weight loads run in a worker thread, so ``/generate`` keeps answering during an update (requests
queued meanwhile wait for the swap; requests in flight finish on the old version and say so).
There is no authentication: bind it to loopback unless the network is trusted. The command line
that serves a checkpoint is ``k3rl rollout-server`` (``flows/cli_serve.py``); engines and weight
updates from checkpoints are ``checkpoints.py``.
"""

# no ``from __future__ import annotations``: FastAPI reads the handlers' annotations (``Request``,
# imported inside ``create_app``) as objects, not as strings to resolve in this module's globals

import asyncio
import base64
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from k3core.rollout.checkpoints import checkpoint_state_for

if TYPE_CHECKING:  # torch and fastapi are imported where used: importing this module stays light
    from k3core.rollout.engine import RolloutEngine

__all__ = ["DEFAULT_PORT", "BadRequest", "create_app", "stop_string_checker", "tokenizer_for"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 30000  # SGLang's default

_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "n", "seed",
                  "sampling_seed", "ignore_eos", "no_stop_trim"}
# SGLang fields that change nothing here (detokenisation details, defaults we already follow)
_IGNORED_SAMPLING_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "min_p", "frequency_penalty",
                          "presence_penalty", "repetition_penalty", "min_new_tokens", "stream_interval"}
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0}
_REQUEST_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "return_routed_experts", "rid", "stream",
                 "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}


class BadRequest(ValueError):
    """A request the server refuses as malformed (HTTP 400)."""


# ------------------------------------------------------------------ request parsing
def _prompts(body: dict, tokenizer) -> tuple[list[list[int]], bool]:
    """(prompts as token ids, whether the request was a batch)."""
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise BadRequest("give exactly one of 'input_ids' (token ids) and 'text'")
    if has_text:
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer on the server: send 'input_ids'")
        text = body["text"]
        if isinstance(text, str):
            return [tokenizer.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tokenizer.encode(t) for t in text], True
        raise BadRequest("'text' must be a string or a non-empty list of strings")
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return [ids], False
    if (isinstance(ids, list) and ids and all(isinstance(p, list) and p for p in ids)
            and all(isinstance(t, int) and not isinstance(t, bool) for p in ids for t in p)):
        return ids, True
    raise BadRequest("'input_ids' must be a non-empty list of token ids or a list of such lists")


def _sampling(sp: Any, eos_id: int | None) -> tuple[Any, list[str], bool]:
    """SGLang ``sampling_params`` -> (engine SamplingParams, stop strings, no_stop_trim)."""
    from k3core.rollout.engine import SamplingParams

    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise BadRequest("'sampling_params' must be an object")
    unknown = sorted(set(sp) - _SAMPLING_KEYS - _IGNORED_SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unsupported sampling_params {unknown}; supported: {sorted(_SAMPLING_KEYS)}")
    for k, neutral in _NEUTRAL.items():
        if k in sp and sp[k] is not None and sp[k] != neutral:
            raise BadRequest(f"sampling_params.{k}={sp[k]!r} is not supported (only {neutral})")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of them")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise BadRequest("'stop_token_ids' must be a list of token ids")
    if eos_id is not None and not sp.get("ignore_eos", False):
        stop_ids = stop_ids + [eos_id]  # SGLang stops at the end-of-sequence token unless ignore_eos
    seed = sp.get("seed") if sp.get("seed") is not None else sp.get("sampling_seed")
    top_k = sp.get("top_k", -1)
    try:
        params = SamplingParams(
            max_new_tokens=int(sp.get("max_new_tokens", 128)), temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)), top_k=0 if top_k in (None, -1) else int(top_k),
            stop_token_ids=tuple(dict.fromkeys(stop_ids)), n=int(sp.get("n", 1)),
            seed=None if seed is None else int(seed))
        params.validate()
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from e
    return params, stop, bool(sp.get("no_stop_trim", False))


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
def create_app(engine: "RolloutEngine", tokenizer=None, model_path: str | None = None):
    """The FastAPI app over ``engine``. Its lifespan starts the engine's decode thread and stops it."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    from k3core.rollout.engine import EngineOverloaded, EngineStopped

    state = {"model_path": model_path}

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

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except Exception as e:
            raise BadRequest(f"the body is not JSON ({e})") from e
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    @app.post("/generate")
    async def generate(request: Request):
        t0 = time.perf_counter()
        try:
            body = await body_of(request)
            unknown = sorted(set(body) - _REQUEST_KEYS)
            if unknown:
                raise BadRequest(f"unsupported fields {unknown}")
            if body.get("stream"):
                raise BadRequest("streaming is not supported: send stream=false")
            if body.get("top_logprobs_num"):
                raise BadRequest("top_logprobs_num is not supported (output_token_logprobs only)")
            prompts, batch = _prompts(body, tokenizer)
            sps = body.get("sampling_params")
            if isinstance(sps, list):
                if len(sps) != len(prompts):
                    raise BadRequest(f"{len(sps)} sampling_params for {len(prompts)} prompts")
            else:
                sps = [sps] * len(prompts)
            eos = getattr(tokenizer, "eos_id", None) if tokenizer is not None else engine.config.eos_token_id
            parsed = [_sampling(sp, eos) for sp in sps]
            for _, stops, _ in parsed:
                if stops and tokenizer is None:
                    raise BadRequest("stop strings need a tokenizer and this server has none for this model: "
                                     "use stop_token_ids")
            reqs = [(p, params, stop_string_checker(tokenizer, stops) if stops else None)
                    for p, (params, stops, _) in zip(prompts, parsed)]
            futures = engine.submit_many(reqs)
        except (BadRequest, ValueError) as e:
            return error(400, str(e))
        except EngineOverloaded as e:
            return error(503, str(e), **{"Retry-After": "1"})
        except EngineStopped as e:
            return error(503, str(e))
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except EngineStopped as e:
            return error(503, str(e))
        except Exception as e:
            log.exception("generation failed")
            return error(500, f"generation failed: {type(e).__name__}: {e}")
        rid = body.get("rid") or uuid.uuid4().hex
        outs = [_output(c, tokenizer, nst, bool(body.get("return_logprob")), bool(body.get("return_routed_experts")),
                        f"{rid}-{i}-{c.sample_index}", t0)
                for i, (comps, (_, _, nst)) in enumerate(zip(results, parsed)) for c in comps]
        return JSONResponse(outs if batch or len(outs) > 1 else outs[0])

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
            body = await body_of(request)
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise BadRequest("'model_path' (a checkpoint directory in the public layout) is required")
            if body.get("load_format") not in (None, "auto", "safetensors"):
                raise BadRequest(f"load_format {body['load_format']!r} is not supported (auto/safetensors)")
            if body.get("abort_all_requests"):
                raise BadRequest("abort_all_requests is not supported: requests in flight finish on the old version")
            version = _version(body.get("weight_version"), engine.weight_version)
        except BadRequest as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)

        def load():
            sd, declared = checkpoint_state_for(engine, path)
            if declared is not None and body.get("weight_version") is not None and not _same(declared, version):
                raise ValueError(f"{path} declares weight version {declared}, the request says {version}")
            engine.load_weights(sd, declared if declared is not None and body.get("weight_version") is None else version)
            state["model_path"] = path

        return await _update(load, version, path)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        try:
            body = await body_of(request)
        except BadRequest as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)

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
                "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None, "load": engine.load()}

    return app


def _same(a, b) -> bool:
    return str(a) == str(b)


def _version(v, current):
    """A request's weight_version: an int (or a numeric string), default the current one + 1."""
    if v is None:
        if isinstance(current, int):
            return current + 1
        raise BadRequest("'weight_version' is required (the current one is not a number)")
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise BadRequest(f"'weight_version' must be an integer or a string, got {v!r}")
    return int(v) if isinstance(v, str) and v.lstrip("-").isdigit() else v


def tokenizer_for(config):
    """The byte-level tokenizer where the vocabulary is one (the CPU presets), else None."""
    from k3core.tokenizer import ByteTokenizer

    try:
        return ByteTokenizer(config)
    except ValueError:
        return None
