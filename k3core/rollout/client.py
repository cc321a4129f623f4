"""One client for rollouts, wherever the engine runs: ``local`` (the in-process ``RolloutEngine``) or a
URL (``k3rl rollout-server``, or a real SGLang server serving K3: only SGLang's native fields are sent).

``RolloutClient.generate(prompts, params, pad_id=None, expected_version=None)`` has the engine's
signature and returns the same ``Completion`` objects, so the pipeline's rollout code does not care
which it holds. Against a URL, each (prompt, sample) goes as its own one-sample ``/generate`` request
(``sampling_seed`` = the seed the local engine would give that sample: ``derive_seed(seed, i) + j``),
sent concurrently so the server batches them; the results equal the local engine's for the same
weights and seed. ``ignore_eos`` is sent so that only the caller's ``stop_token_ids`` stop a sample,
as in the engine. Routed experts come back as SGLang's ``routed_experts`` (base64 int32; a real
SGLang needs ``--enable-return-routed-experts``).

Failures say what happened: ``ServerUnavailable`` (nothing listens, after ``retries`` attempts with
exponential backoff), ``ServerOverloaded`` (503 after the same retries), ``RolloutTimeout`` (no answer
within ``timeout``), ``RequestRefused`` (4xx, with the server's reason; a refused weight update is
``WeightUpdateRefused``), ``WeightVersionMismatch`` (the engine serves another version than the
caller expects, checked before generating and on every answer).
"""

from __future__ import annotations

import base64
import os
import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import torch

from k3core.rollout.checkpoints import checkpoint_state_for
from k3core.rollout.engine import Completion, RolloutEngine, SamplingParams, derive_seed
from k3core.transfer import load_payload

_MASK63 = (1 << 63) - 1


class RolloutClientError(RuntimeError):
    """Base of every client error."""


class ServerUnavailable(RolloutClientError):
    """Nothing answers at the URL (down, wrong port, not started yet)."""


class ServerOverloaded(RolloutClientError):
    """The server kept answering 503 (its queue is full)."""


class RolloutTimeout(RolloutClientError):
    """The server accepted the connection but did not answer in time."""


class RequestRefused(RolloutClientError):
    """The server refused the request (HTTP 4xx) or failed it (5xx other than 503)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class WeightUpdateRefused(RequestRefused):
    """A weight update was refused; the server keeps serving its previous version."""


class ServerWouldComputeWrongly(WeightUpdateRefused, ValueError):
    """The server is an SGLang that would compute the pushed checkpoint wrongly (the reasons are in the
    message; ``k3core.rollout.sglang_serving.serving_problems``). Nothing was sent. A ``ValueError``: bad
    input that a retry cannot fix, so the stages do not retry it (``tasks.common.NON_RETRYABLE``)."""


class WeightVersionMismatch(RolloutClientError):
    """The engine serves another weight version than the caller expects."""


def _same_version(a, b) -> bool:
    return str(a) == str(b)


class RolloutClient:
    """``target``: "local" (then ``engine`` is the in-process engine) or "http://host:port".
    ``timeout``: seconds for one HTTP answer (a generation included); ``retries``/``backoff``: on
    connection errors and 503, retry after ``backoff * 2**attempt`` seconds (at most 10 s each);
    ``max_concurrency``: requests in flight at once; ``routing``: ask for routed expert ids;
    ``config``: the model's K3Config (needed for routed experts when the server's
    ``/get_model_info`` does not say the MoE shape, as a real SGLang's does not)."""

    def __init__(self, target: str = "local", engine: RolloutEngine | None = None, *, timeout: float = 600.0,
                 retries: int = 4, backoff: float = 0.5, max_concurrency: int = 64, routing: bool = True, config=None,
                 api_key: str | None = None):
        self.target, self.engine = target, engine
        # the server's --api-key (sent as 'Authorization: Bearer'); default from K3RL_ROLLOUT_API_KEY
        self.api_key = api_key if api_key is not None else os.environ.get("K3RL_ROLLOUT_API_KEY") or None
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.max_concurrency, self.routing, self.config = max_concurrency, routing, config
        if target == "local":
            if engine is None:
                raise ValueError("a local RolloutClient needs the engine: RolloutClient('local', engine=...)")
            self.url = None
        else:
            u = urlparse(target)
            if u.scheme not in ("http", "https") or not u.netloc:
                raise ValueError("rollout target must be 'local' or an http(s) URL like http://127.0.0.1:30000, "
                                 f"got {target!r}")
            self.url = target.rstrip("/")
            # loopback never goes through an environment proxy
            handlers = [urllib.request.ProxyHandler({})] if u.hostname in ("127.0.0.1", "localhost", "::1") else []
            self._opener = urllib.request.build_opener(*handlers)
        self._moe_shape: tuple[int, int] | None = None

    @property
    def is_local(self) -> bool:
        return self.url is None

    def __repr__(self) -> str:
        return f"RolloutClient({self.target!r})"

    # ------------------------------------------------------------------ HTTP
    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        """(status, parsed JSON or None). Retries connection errors and 503; raises the client errors."""
        data = None if body is None else json.dumps(body).encode()
        url = self.url + path
        for attempt in range(self.retries + 1):
            headers = {"Content-Type": "application/json"}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            req = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with self._opener.open(req, timeout=timeout or self.timeout) as r:
                    raw = r.read()
                    return r.status, (json.loads(raw) if raw else None)
            except urllib.error.HTTPError as e:
                raw = e.read()
                try:
                    payload = json.loads(raw) if raw else None
                except ValueError:
                    payload = {"message": raw.decode("utf-8", "replace")}
                if e.code != 503:
                    return e.code, payload
                if attempt == self.retries:
                    raise ServerOverloaded(f"rollout server at {self.url} is overloaded: {path} answered 503 "
                                           f"{self.retries + 1} times ({_message(payload)}); lower the request rate "
                                           "or raise its --max-queue") from None
            except TimeoutError as e:
                raise RolloutTimeout(f"rollout server at {self.url} did not answer {path} within "
                                     f"{timeout or self.timeout:.0f} s") from e
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    raise RolloutTimeout(f"rollout server at {self.url} did not answer {path} within "
                                         f"{timeout or self.timeout:.0f} s") from e
                if attempt == self.retries:
                    raise ServerUnavailable(f"rollout server at {self.url} is not reachable ({reason}) after "
                                            f"{self.retries + 1} attempts: is it running (k3rl rollout-server --checkpoint "
                                            "DIR --port P)?") from e
            time.sleep(min(10.0, self.backoff * 2 ** attempt))
        raise AssertionError("unreachable")

    def _ok(self, method: str, path: str, body: dict | None = None, refused=RequestRefused):
        status, payload = self._call(method, path, body)
        if status >= 400:
            raise refused(f"rollout server at {self.url} refused {path} (HTTP {status}): {_message(payload)}", status)
        return payload

    # ------------------------------------------------------------------ API
    def health(self) -> bool:
        """True when the engine is up and decoding (never raises for a dead server)."""
        if self.is_local:
            return True
        try:
            status, _ = self._call("GET", "/health", timeout=min(self.timeout, 10.0))
        except RolloutClientError:
            return False
        return status == 200

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Poll ``/health`` until the server answers 200, or raise ``ServerUnavailable``."""
        deadline = time.monotonic() + timeout
        saved, self.retries = self.retries, 0
        try:
            while not self.health():
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"rollout server at {self.url} not healthy within {timeout:.0f} s")
                time.sleep(0.2)
        finally:
            self.retries = saved

    def model_info(self) -> dict:
        if self.is_local:
            e = self.engine
            return {"weight_version": e.weight_version, "vocab_size": e.config.vocab_size,
                    "num_moe_layers": len(e.model.moe_layer_ids), "num_experts_per_token": e.config.num_experts_per_token,
                    "load": e.load()}
        return self._ok("GET", "/get_model_info")

    def weight_version(self):
        return self.model_info()["weight_version"]

    def check_version(self, expected) -> None:
        got = self.weight_version()
        if not _same_version(got, expected):
            raise WeightVersionMismatch(f"{self._where()} serves weight version {got}, the caller expects {expected}: "
                                        "push the weights first (update_weights_from_disk / a transfer)")

    def update_weights_from_disk(self, model_path: str, weight_version) -> dict:
        if self.is_local:
            sd, declared = checkpoint_state_for(self.engine, model_path)
            if declared is not None and not _same_version(declared, weight_version):
                raise WeightUpdateRefused(f"{model_path} declares weight version {declared}, the caller says "
                                          f"{weight_version}", 400)
            self.engine.load_weights(sd, weight_version)
            return {"success": True, "weight_version": weight_version}
        problems = self.serving_problems(model_path)
        if problems:
            raise ServerWouldComputeWrongly(f"refusing to push {model_path} to the SGLang server at {self.url}:\n  - "
                                            + "\n  - ".join(problems), 409)
        body = {"model_path": str(model_path), "weight_version": weight_version}
        return self._ok("POST", "/update_weights_from_disk", body, refused=WeightUpdateRefused)

    def server_info(self) -> dict | None:
        """The server's ``/get_server_info`` (SGLang answers its server arguments and version), or None
        when it has none (k3rl's rollout server). Asked once per client."""
        if self.is_local:
            return None
        if not hasattr(self, "_server_info"):
            status, payload = self._call("GET", "/get_server_info")
            self._server_info = payload if status == 200 and isinstance(payload, dict) else None
        return self._server_info

    def serving_problems(self, model_path) -> list[str]:
        """Why the server would compute the checkpoint at ``model_path`` wrongly: empty unless the server
        is an SGLang (its ``/get_server_info``) and the checkpoint's config.json is readable here."""
        from k3core.config import K3Config
        from k3core.rollout.sglang_serving import is_sglang, serving_problems

        info = self.server_info()
        cfg = Path(model_path) / "config.json"
        if not is_sglang(info) or not cfg.is_file():
            return []
        return serving_problems(K3Config.from_json_file(cfg), info)

    def update_weights_from_tensor(self, payload: dict) -> dict:
        if self.is_local:
            return {"success": True, "weight_version": load_payload(self.engine, payload)}
        return self._ok("POST", "/update_weights_from_tensor", payload, refused=WeightUpdateRefused)

    def generate(self, prompts: list[list[int]], params: SamplingParams, pad_id: int | None = None,
                 expected_version=None, sessions: list[str | None] | None = None) -> list[Completion]:
        """``n`` Completions per prompt, ordered (prompt, sample), as ``RolloutEngine.generate``.
        ``expected_version``: refuse (``WeightVersionMismatch``) any other version. ``sessions``: per
        prompt, the episode whose kept decode state the turn continues (``RolloutEngine`` sessions;
        sent to k3rl's server as ``session_id``, not to SGLang, whose own prefix cache applies)."""
        params.validate()
        if self.is_local:
            if expected_version is not None:
                self.check_version(expected_version)
            comps = self.engine.generate(prompts, params, pad_id, sessions=sessions)
        else:
            comps = self._generate_remote(prompts, params, expected_version, self._k3rl_sessions(sessions))
        if expected_version is not None:
            bad = [c.weight_version for c in comps if not _same_version(c.weight_version, expected_version)]
            if bad:
                raise WeightVersionMismatch(f"{self._where()} produced {len(bad)} samples with weight version {bad[0]} "
                                            f"while the caller expects {expected_version} (the weights changed mid-rollout)")
        return comps

    # ------------------------------------------------------------------ remote generation
    def _where(self) -> str:
        return "the local engine" if self.is_local else f"rollout server at {self.url}"

    def _routing_shape(self) -> tuple[int, int]:
        if self._moe_shape is None:
            if self.config is not None:
                self._moe_shape = (len(self.config.moe_layers), self.config.num_experts_per_token)
            else:
                info = self.model_info()
                if "num_moe_layers" not in info:
                    raise RolloutClientError(f"{self._where()} does not report its MoE shape: pass config= to RolloutClient")
                self._moe_shape = (info["num_moe_layers"], info["num_experts_per_token"])
        return self._moe_shape

    def _k3rl_sessions(self, sessions):
        from k3core.rollout.sglang_serving import is_sglang

        return None if sessions is None or is_sglang(self.server_info()) else sessions

    def driving(self):
        """The local engine's ``driving()`` (a background driver while many threads generate); a
        server drives itself."""
        from contextlib import nullcontext

        return self.engine.driving() if self.is_local else nullcontext(self)

    def release_sessions(self, sessions: list[str]) -> int:
        """Free the decode state kept for ``sessions`` (their episodes ended); bytes freed."""
        sessions = [s for s in sessions if s is not None]
        if not sessions:
            return 0
        if self.is_local:
            return self.engine.release_sessions(sessions)
        if self._k3rl_sessions(sessions) is None:
            return 0
        return int(self._ok("POST", "/release_sessions", {"session_ids": sessions}).get("freed_bytes", 0))

    def _generate_remote(self, prompts, params: SamplingParams, expected_version, sessions=None) -> list[Completion]:
        if expected_version is not None:
            self.check_version(expected_version)
        if self.routing:
            self._routing_shape()
        base = params.seed if params.seed is not None else secrets.randbits(63)
        jobs = []
        for i, p in enumerate(prompts):
            seed = derive_seed(base, i)
            for j in range(params.n):
                sp = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                      "top_k": params.top_k if params.top_k > 0 else -1, "stop_token_ids": list(params.stop_token_ids),
                      "n": 1, "sampling_seed": (seed + j) & _MASK63, "ignore_eos": True}
                body = {"input_ids": list(p), "sampling_params": sp, "return_logprob": True}
                if sessions is not None and sessions[i] is not None and params.n == 1:
                    body["session_id"] = sessions[i]
                if self.routing:
                    body["return_routed_experts"] = True
                jobs.append((i, j, list(p), body))
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(jobs))) as pool:
            answers = list(pool.map(lambda job: self._ok("POST", "/generate", job[3]), jobs))
        return [self._completion(i, j, p, a[0] if isinstance(a, list) else a) for (i, j, p, _), a in zip(jobs, answers)]

    def _completion(self, i: int, j: int, prompt: list[int], out: dict) -> Completion:
        meta = out.get("meta_info", {})
        ids = list(out["output_ids"])
        lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
        if len(lps) != len(ids):
            raise RolloutClientError(f"{self._where()} returned {len(lps)} logprobs for {len(ids)} tokens "
                                     "(is return_logprob honoured?)")
        routing = None
        if self.routing:
            if "routed_experts" not in meta:
                raise RolloutClientError(f"{self._where()} returned no routed_experts (a real SGLang needs "
                                         "--enable-return-routed-experts; or build the client with routing=False)")
            n_moe, k = self._routing_shape()
            raw = base64.b64decode(meta["routed_experts"])
            routing = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, n_moe, k).to(torch.int16)
            if routing.shape[0] != len(prompt) + len(ids) - 1:
                raise RolloutClientError(f"{self._where()} returned routing for {routing.shape[0]} positions, expected "
                                         f"{len(prompt) + len(ids) - 1}")
        fr = meta.get("finish_reason") or {}
        reason = fr.get("type", "length") if isinstance(fr, dict) else str(fr)
        matched = fr.get("matched", fr.get("length")) if isinstance(fr, dict) else None
        spans = {str(s.get("version")) for s in meta.get("weight_versions") or [] if isinstance(s, dict)}
        if len(spans) > 1:  # SGLang: the weights changed while this sample was generated
            raise WeightVersionMismatch(f"{self._where()} generated one sample under weight versions {sorted(spans)} "
                                        "(the weights changed mid-sample); its tokens mix two policies")
        version = meta.get("weight_version")
        if isinstance(version, str) and version.lstrip("-").isdigit():
            version = int(version)  # SGLang reports versions as strings
        return Completion(i, j, list(prompt), ids, lps, routing, reason, version,
                          {"matched": matched, "id": meta.get("id")})


def _message(payload) -> str:
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in payload:
            return str(payload["message"])
        if "detail" in payload:
            return str(payload["detail"])
    return json.dumps(payload)[:500] if payload is not None else "no body"
