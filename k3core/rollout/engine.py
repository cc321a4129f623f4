"""Embedded rollout engine: continuous-batching generation around one ``K3ForCausalLM``.

The engine knows nothing about tokenization or rewards: token ids in, token ids out, with per-token
log-probabilities, the routed expert ids of every position (for routing replay) and the weight
version that produced them. Stop strings need a tokenizer, so they come in as a ``stop_checker``
(output ids -> the matched string or None). A request (prompt, ``SamplingParams``, checker) becomes
``n`` sequences. Each ``step()`` admits waiting sequences while the batch has room and no weight
update waits (their distinct prompts prefilled together, their rows joining the running decode
state), samples one token per running sequence, retires those that stopped (a request's future
resolves once all its samples are done), and decodes the survivors one token. The decode state
and its modes: ``k3core.rollout.decode_state``; sampling and seeds: ``k3core.rollout.sampling``.

Weight updates and the sequences in flight (``load_weights``'s ``in_flight``, ``IN_FLIGHT``):
``"drain"`` (the default) swaps only between batches: the running sequences finish on the old weights,
so every sequence comes from the one version its ``Completion`` records. ``"continue"`` swaps between
two steps: the running sequences go on with the new weights from the next token, on the decode state
(KDA recurrent states, conv tails, MLA latents) the old weights computed, the partial rollout of
AReaL and slime. ``"abort"`` puts the running sequences back at the head of the queue, restarted
from their prompts with their own seeds: they are sampled again whole by the new weights. Every
output token records the version whose logits it was sampled from (``Completion.token_versions``),
so a correction can use per-token behaviour log-probabilities.

Sessions (multi-turn episodes, ``k3core.rl.episodes``): a request may name a ``session``. When its
sequence ends at a stop id, the engine keeps that row's decode state (KDA recurrent states, conv
tails, MLA latents; the state after every id but the last sampled one) with the ids it has consumed
and their routing. The session's next request, whose prompt extends those ids (the sampled stop id,
then the tool results and the next generation prompt), prefills only the new ids on top of the kept
state: a hybrid model's prefix cache, the analogue of SGLang keeping Mamba states. A prompt that does
not extend the kept ids, a weight update since, or a kept state evicted under ``session_bytes``
(least recently kept first) means an ordinary full prefill: re-prefill is the fallback, and both
give the same tokens up to rounding. ``release_sessions`` frees an episode's state when it ends.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict, deque
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from collections.abc import Callable

import torch

from k3core.model import K3Cache, K3ForCausalLM
from k3core.model.norm import at_least_fp32
from k3core.rollout.decode_state import new_decode_state, resolve_decode
from k3core.rollout.sampling import SamplingParams, derive_seed, sample_batch, sample_generator
from k3core.settings import DECODE_MODES, IN_FLIGHT

__all__ = ["IN_FLIGHT", "Completion", "EngineOverloaded", "EngineStopped", "RolloutEngine", "SamplingParams", "StopChecker",
           "derive_seed"]

log = logging.getLogger(__name__)

StopChecker = Callable[[list[int]], "str | None"]


_FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # weights checked for NaN/inf on update


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    routing: torch.Tensor | None  # [len(prompt)+len(output)-1, n_moe, k] int16, prompt positions first
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int = 0  # the version that sampled the first output token (at admission)
    # "matched": the stop token id or stop string; "admitted_step"/"finished_step": engine steps;
    # "logits": [len(output), V] rows sampled from, fp32 or wider (only with record_logits)
    meta: dict = field(default_factory=dict)
    token_versions: list[int] | None = None  # per output token, the version whose logits it was sampled from


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: retry later (the HTTP server answers 503)."""


class EngineStopped(RuntimeError):
    """The engine's driver was stopped before the request finished."""


# ------------------------------------------------------------------ requests
@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    stop_checker: StopChecker | None
    future: Future
    prompt_index: int = 0
    completions: list = field(default_factory=list)
    pending: int = 0
    session: str | None = None
    seed: int = 0


@dataclass(eq=False)
class _Kept:
    """A finished turn's decode state, kept for its session's next turn (one-row ``K3Cache``)."""

    ids: list[int]  # the ids the state has consumed (prompt and output but the last sampled id)
    cache: K3Cache
    routing: torch.Tensor  # [len(ids), n_moe, k] int16: routing of those positions
    version: int
    nbytes: int


@dataclass(eq=False)
class _Seq:
    req: _Request
    sample_index: int
    gen: torch.Generator
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    prompt_routing: torch.Tensor | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    version: int = 0
    admitted_step: int = -1
    versions: list[int] = field(default_factory=list)  # per output token: the version of its logits
    logits_version: int = 0  # the version of the forward that computed this row's next-token logits

    def restart(self) -> None:
        """Back to before admission (aborted at a weight update): no output, the seed's generator anew."""
        self.gen = sample_generator(self.req.seed, self.sample_index)
        self.out_ids, self.logprobs, self.routes, self.logits, self.versions = [], [], [], [], []
        self.prompt_routing, self.admitted_step = None, -1


class RolloutEngine:
    """Continuous-batching generation around an inference model (see the module docstring).

    ``model``: a ``K3ForCausalLM`` (float or W4A8 experts), taken over: eval mode, inference caches on.
    ``max_batch``: most sequences decoded together; ``max_queue``: most waiting sequences ``submit``
    accepts; ``record_logits``: keep every sampled-from logits row in ``Completion.meta`` (tests);
    ``decode``: "dynamic", "static" or "graph" (``k3core.rollout.decode_state``), a resolved mode
    (``k3core.device.decode_mode`` resolves a run's "auto"); ``session_bytes``: most bytes of decode
    state kept for sessions between turns (0: none kept, every turn re-prefills)."""

    def __init__(self, model: K3ForCausalLM, weight_version: int = 0, max_batch: int = 256, max_queue: int = 4096,
                 record_logits: bool = False, decode: str = "dynamic", session_bytes: int = 4 << 30):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch}, {max_queue}")
        if session_bytes < 0:
            raise ValueError(f"session_bytes must be >= 0, got {session_bytes}")
        if decode not in DECODE_MODES or decode == "auto":  # "auto" has one meaning: k3core.device.decode_mode's
            raise ValueError(f"decode must be one of {DECODE_MODES[1:]} (resolved), got {decode!r}")
        self.model = model.eval()
        self.model.use_inference_caches = True
        self.model.refresh_inference_caches()
        self.weight_version = weight_version
        self.config = model.config
        self.max_batch, self.max_queue, self.record_logits = max_batch, max_queue, record_logits
        pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < self.config.vocab_size else 0
        self.device = next(model.parameters()).device
        self.steps = 0
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "admitted": 0, "max_running": 0,
                      "session_hits": 0, "session_misses": 0, "session_evictions": 0, "reused_tokens": 0,
                      "updates_in_flight": 0, "aborted": 0}
        self.session_bytes = session_bytes
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # session -> state, least recently kept first
        self._kept_bytes = 0
        self._queue: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._decode = new_decode_state(resolve_decode(self.model, decode), self.model, max_batch)  # row j: running[j]
        self._logits: torch.Tensor | None = None  # [len(running), V] fp32: next-token logits
        self._paused = 0  # weight updates waiting: no admission
        self._swapping = 0  # in-flight weight updates waiting for the model lock: no new step starts
        self._cv = threading.Condition()  # queue, pause flag, driver wake-ups (held briefly)
        self._model_lock = threading.RLock()  # model weights and the running batch (held per step)
        self._update_lock = threading.Lock()
        self._driver: threading.Thread | None = None
        self._stopping = False

    @property
    def decode_mode(self) -> str:
        """The decode mode this engine runs: "dynamic", "static" or "graph"."""
        return self._decode.mode

    # ------------------------------------------------------------------ weights
    def check_state(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` ("weight transfer refused: ...") unless ``state_dict`` has exactly the
        engine's parameter and persistent-buffer names, with the same shapes and dtypes, and every
        floating-point value finite (a NaN or inf weight would serve garbage; one pass over the new
        weights, before anything is applied)."""
        own = self.model.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(state_dict))
        extra = sorted(set(state_dict) - set(own))
        errs = []
        if missing:
            errs.append(f"missing {len(missing)} tensors (e.g. {missing[:3]})")
        if extra:
            errs.append(f"{len(extra)} unexpected tensors (e.g. {extra[:3]})")
        for k in sorted(set(own) & set(state_dict)):
            t, o = state_dict[k], own[k]
            if not isinstance(t, torch.Tensor):
                errs.append(f"{k} is a {type(t).__name__}, not a tensor")
            elif tuple(t.shape) != tuple(o.shape):
                errs.append(f"{k} has shape {tuple(t.shape)}, engine expects {tuple(o.shape)}")
            elif t.dtype != o.dtype:
                errs.append(f"{k} has dtype {t.dtype}, engine expects {o.dtype}")
            elif t.dtype in _FINITE_CHECKED and not bool(torch.isfinite(t).all()):
                errs.append(f"{k} holds non-finite values (NaN or inf)")
        if errs:
            raise ValueError("weight transfer refused (the engine keeps serving weight version "
                             f"{self.weight_version}): " + "; ".join(errs[:6]) + (" ..." if len(errs) > 6 else ""))

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], weight_version: int, refresh: bool = True,
                     in_flight: str = "drain") -> None:
        """Swap in new weights as ``weight_version``. Checked first (``check_state``: on a mismatch
        nothing is copied and the old version keeps serving). Then admission pauses and the running
        sequences are dealt with as ``in_flight`` says (the module docstring: ``"drain"`` lets them
        finish on the old weights, queued requests waiting; ``"continue"`` keeps them running on the new
        ones; ``"abort"`` requeues them), and under the model lock, between two steps, the weights are
        copied into the existing tensors and every weight-derived cache is recomputed in place
        (AttnRes ``w * gamma``; the absorbed MLA matrices are views of ``kv_b_proj``), so captured
        decode graphs read the new weights (the decode state captures again should storage have
        moved); the new version is published and admission resumes. ``refresh=False`` exists only so
        a test can show what a stale AttnRes cache does."""
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT}, got {in_flight!r}")
        self.check_state(state_dict)
        with self._update_lock:
            with self._cv:
                self._paused += 1
                self._swapping += in_flight != "drain"
            try:
                if in_flight == "drain":
                    self._drain()
                with self._model_lock:
                    if self._running:
                        self.stats["updates_in_flight"] += 1
                        if in_flight == "abort":
                            self._requeue_running()
                    own = self.model.state_dict(keep_vars=True)
                    for k, t in state_dict.items():
                        own[k].copy_(t)
                    if refresh:
                        self.model.refresh_inference_caches()
                    self._decode.weights_loaded()
                    self.weight_version = weight_version
                    self._kept.clear()  # computed under the old weights: the next turns re-prefill
                    self._kept_bytes = 0
            finally:
                with self._cv:
                    self._paused -= 1
                    self._swapping -= in_flight != "drain"
                    self._cv.notify_all()

    def _requeue_running(self) -> None:
        """Put the running sequences back at the head of the queue, restarted (``_Seq.restart``)."""
        running = self._running
        self._clear_batch()
        for s in running:
            s.restart()
        with self._cv:
            self._queue.extendleft(reversed(running))
        self.stats["aborted"] += len(running)

    def _drain(self) -> None:
        """Wait (admission paused) until no sequence is running; step ourselves without a driver."""
        while True:
            with self._model_lock:
                if not self._running:
                    return
            if self.is_serving:
                with self._cv:
                    self._cv.wait(0.05)
            else:
                self.step()

    # ------------------------------------------------------------------ requests
    def _check_prompt(self, prompt: list[int]) -> list[int]:
        p = [int(t) for t in prompt]
        if not p:
            raise ValueError("every prompt needs at least one token (prompts: non-empty lists of token ids)")
        V = self.config.vocab_size
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {V}): tokenize with this model's tokenizer")
        return p

    def submit_many(self, requests: list[tuple[list[int], SamplingParams, StopChecker | None]],
                    bounded: bool = True, prompt_indices: list[int] | None = None,
                    sessions: list[str | None] | None = None) -> list[Future]:
        """Queue requests (all or none); each future resolves to its ``n`` Completions in sample order.
        ``bounded``: refuse (``EngineOverloaded``) when the queue would exceed ``max_queue``;
        ``sessions``: per request, the session whose kept state it continues and keeps (or None)."""
        if sessions is not None and len(sessions) != len(requests):
            raise ValueError(f"{len(sessions)} sessions for {len(requests)} requests: give one per request (or None)")
        built = []
        for i, (prompt, params, checker) in enumerate(requests):
            params.validate()
            p = self._check_prompt(prompt)
            session = sessions[i] if sessions else None
            if session is not None and params.n != 1:
                raise ValueError(f"session {session!r}: a session is one trajectory, so its requests take n=1 "
                                 f"(got n={params.n}); give each sample its own session")
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            req = _Request(p, params, checker, Future(), prompt_indices[i] if prompt_indices else 0,
                           [None] * params.n, params.n, session, seed)
            seqs = [_Seq(req, j, sample_generator(seed, j)) for j in range(params.n)]
            built.append((req, seqs))
        n_new = sum(len(s) for _, s in built)
        with self._cv:
            if self._stopping:
                raise EngineStopped("the rollout engine is shutting down")
            if bounded and len(self._queue) + n_new > self.max_queue:
                raise EngineOverloaded(f"rollout engine overloaded: {len(self._queue)} sequences waiting, "
                                       f"{len(self._running)} running, queue limit {self.max_queue}; retry later")
            for _, seqs in built:
                self._queue.extend(seqs)
            self._cv.notify_all()
        return [req.future for req, _ in built]

    def submit(self, prompt: list[int], params: SamplingParams, stop_checker: StopChecker | None = None) -> Future:
        return self.submit_many([(prompt, params, stop_checker)])[0]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, pad_id: int | None = None,
                 first_index: int = 0, sessions: list[str | None] | None = None) -> list[Completion]:
        """Blocking batch generation: ``n`` Completions per prompt, ordered (prompt, sample). Prompt
        ``i`` gets request seed ``derive_seed(params.seed, first_index + i)``, so the prompts of a
        larger call generated as consecutive shards (``first_index``: the shard's first position)
        get that call's samples. ``pad_id`` is accepted for compatibility: pads are neutral, so
        their id never changes a result. ``sessions``: as for ``submit_many``. Callable from many threads
        at once (one per agent episode): without a driver, each caller steps the shared batch in turn
        until its own requests are done."""
        params.validate()
        if not prompts:
            raise ValueError("every prompt needs at least one token (prompts: non-empty lists of token ids)")
        base = params.seed if params.seed is not None else secrets.randbits(63)
        reqs = [(p, replace(params, seed=derive_seed(base, first_index + i)), None) for i, p in enumerate(prompts)]
        futures = self.submit_many(reqs, bounded=False, prompt_indices=list(range(len(prompts))), sessions=sessions)
        while not all(f.done() for f in futures):
            if self.is_serving:
                for f in futures:  # the driver resolves them; errors re-raise below
                    f.exception()
            elif not self.step() and not all(f.done() for f in futures):  # another caller's step may finish ours
                with self._cv:
                    paused = self._paused
                if not paused:
                    raise RuntimeError("rollout engine made no progress with requests pending")
                with self._cv:
                    self._cv.wait(0.05)
        return [c for f in futures for c in f.result()]

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def step(self) -> bool:
        """Admit, sample one token per running sequence, retire, decode. False when idle. Waits first
        while an in-flight weight update waits for the model lock (a thread stepping in a loop would
        otherwise take it back at once)."""
        with self._cv:
            while self._swapping:
                self._cv.wait(0.05)
        with self._model_lock:
            try:
                joined = self._admit()
                if not self._running:
                    return joined
                self._sample_and_decode()
                return True
            except Exception as e:
                self._fail_running(e)
                raise

    def _admit(self) -> bool:
        with self._cv:
            if self._paused or not self._queue or len(self._running) >= self.max_batch:
                return False
            take = [self._queue.popleft() for _ in range(min(self.max_batch - len(self._running), len(self._queue)))]
        fresh, continued = [], {}  # continued: new-id count -> [(sequence, its kept state)]
        for s in take:
            kept = self._resume(s)
            if kept is None:
                fresh.append(s)
            else:
                continued.setdefault(len(s.req.prompt) - len(kept.ids), []).append((s, kept))
        take = fresh + [s for group in continued.values() for s, _ in group]  # the order of the prefilled rows
        self._running.extend(take)  # before prefill, so a failure fails them too
        parts = ([self._prefill(fresh)] if fresh else []) + [self._prefill_continued(g) for g in continued.values()]
        cache = parts[0][0] if len(parts) == 1 else K3Cache.concat([c for c, _ in parts])
        logits = parts[0][1] if len(parts) == 1 else torch.cat([lg for _, lg in parts])
        for s in take:
            s.version, s.admitted_step, s.logits_version = self.weight_version, self.steps, self.weight_version
        n_old = len(self._running) - len(take)
        self._decode.admit(cache, n_old, max(len(s.req.prompt) + s.req.params.max_new_tokens for s in self._running))
        self._logits = logits if n_old == 0 else torch.cat([self._logits, logits])
        self.stats["admitted"] += len(take)
        self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        return True

    def _prefill(self, take: list[_Seq]) -> tuple[K3Cache, torch.Tensor]:
        """Prefill whole prompts (left-padded together; ``n`` samples of one prompt share its
        prefill) -> (cache, next-token logits), one row per sequence."""
        rows: list[int] = []
        uniq: dict[tuple[int, ...], int] = {}
        for s in take:
            rows.append(uniq.setdefault(tuple(s.req.prompt), len(uniq)))
        prompts = list(uniq)
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), P, dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p)
            mask[b, P - len(p):] = True
        cache = K3Cache.empty(self.config)
        out = self.model(ids.to(self.device), mask.to(self.device), cache=cache, return_routing=True)
        logits = at_least_fp32(out.logits[:, -1])
        routing = out.routing.to(torch.int16).cpu()
        if len(prompts) != len(take):
            idx = torch.tensor(rows, device=self.device)
            cache, logits = cache.index_select(idx), logits.index_select(0, idx)
        for s, r in zip(take, rows):
            s.prompt_routing = routing[r, P - len(s.req.prompt):].clone()
        self.stats["prefill_tokens"] += int(mask.sum())
        return cache, logits

    def _prefill_continued(self, group: list[tuple[_Seq, _Kept]]) -> tuple[K3Cache, torch.Tensor]:
        """Prefill only the ids each prompt adds to its session's kept state, on top of it. Every
        member adds the same number of ids: no pad sits between kept and new ids (a pad there would
        shift the KDA conv tails)."""
        cache = group[0][1].cache if len(group) == 1 else K3Cache.concat([k.cache for _, k in group])
        ids = torch.tensor([s.req.prompt[len(k.ids):] for s, k in group], dtype=torch.long)
        out = self.model(ids.to(self.device), torch.ones(ids.shape, dtype=torch.bool, device=self.device),
                         cache=cache, return_routing=True)
        routing = out.routing.to(torch.int16).cpu()
        for b, (s, k) in enumerate(group):
            s.prompt_routing = torch.cat([k.routing, routing[b]])
        self.stats["prefill_tokens"] += ids.numel()
        return cache, at_least_fp32(out.logits[:, -1])

    # ------------------------------------------------------------------ sessions
    def _resume(self, s: _Seq) -> _Kept | None:
        """The kept state ``s`` continues (taken: it is this sequence's now), or None: full prefill."""
        if s.req.session is None:
            return None
        kept = self._kept.pop(s.req.session, None)
        if kept is not None:
            self._kept_bytes -= kept.nbytes
        p, n = s.req.prompt, (len(kept.ids) if kept is not None else 0)
        if kept is None or kept.version != self.weight_version or len(p) <= n or p[:n] != kept.ids:
            self.stats["session_misses"] += 1
            return None
        self.stats["session_hits"] += 1
        self.stats["reused_tokens"] += n
        return kept

    def _keep(self, s: _Seq, row: int, routing: torch.Tensor) -> None:
        """Keep running row ``row``'s state for ``s``'s session (it stopped); evict the least recently
        kept states beyond ``session_bytes``."""
        cache = self._decode.row(row)
        kept = _Kept(s.req.prompt + s.out_ids[:-1], cache, routing, s.version, cache.nbytes())
        self._kept[s.req.session] = kept
        self._kept_bytes += kept.nbytes
        while self._kept and self._kept_bytes > self.session_bytes:
            _, old = self._kept.popitem(last=False)
            self._kept_bytes -= old.nbytes
            self.stats["session_evictions"] += 1

    def release_sessions(self, sessions) -> int:
        """Free the kept state of ``sessions`` (their episodes ended); unknown ids are ignored.
        Returns the bytes freed."""
        freed = 0
        with self._model_lock:
            for sid in sessions:
                kept = self._kept.pop(sid, None)
                if kept is not None:
                    freed += kept.nbytes
            self._kept_bytes -= freed
        return freed

    def kept_sessions(self) -> dict:
        """How many sessions hold kept state, and its bytes."""
        with self._model_lock:
            return {"sessions": len(self._kept), "bytes": self._kept_bytes}

    def _finish(self, s: _Seq, tok: int) -> tuple[str, object] | None:
        p = s.req.params
        if tok in p.stop_token_ids:
            return "stop", tok
        if s.req.stop_checker is not None:
            try:
                m = s.req.stop_checker(s.out_ids)
            except Exception as e:  # a broken checker ends its request, not the batch
                return "abort", f"stop_checker raised {type(e).__name__}: {e}"
            if m is not None:
                return "stop", m
        if len(s.out_ids) >= p.max_new_tokens:
            return "length", p.max_new_tokens
        return None

    def _sample_and_decode(self) -> None:
        logits = self._logits
        tok, lp = sample_batch(logits, [s.req.params for s in self._running], [s.gen for s in self._running])
        toks, lps = tok.tolist(), lp.tolist()
        keep = []
        for j, s in enumerate(self._running):
            s.out_ids.append(toks[j])
            s.logprobs.append(lps[j])
            s.versions.append(s.logits_version)
            if self.record_logits:
                s.logits.append(logits[j].cpu())
            fin = self._finish(s, toks[j])
            if fin is None:
                keep.append(j)
            else:
                self._complete(s, *fin, row=j)
        self.steps += 1
        self.stats["decode_tokens"] += len(toks)
        if not keep:
            self._clear_batch()
            return
        if len(keep) < len(self._running):
            order = self._decode.retire(keep)
            self._running = [self._running[j] for j in order]
            tok = tok.index_select(0, torch.tensor(order, device=tok.device))
        self._logits, routing = self._decode.step(tok)
        r = routing.to(torch.int16).cpu()
        for j, s in enumerate(self._running):
            s.routes.append(r[j])
            s.logits_version = self.weight_version

    def _complete(self, s: _Seq, reason: str, matched, row: int) -> None:
        req = s.req
        n_moe = s.prompt_routing.shape[1]
        k = s.prompt_routing.shape[2]
        gen_routes = torch.stack(s.routes) if s.routes else torch.zeros(0, n_moe, k, dtype=torch.int16)
        meta = {"matched": matched, "admitted_step": s.admitted_step, "finished_step": self.steps}
        if self.record_logits:
            meta["logits"] = torch.stack(s.logits)
        routing = torch.cat([s.prompt_routing, gen_routes])
        if req.session is not None and reason == "stop" and self.session_bytes:
            self._keep(s, row, routing)
        req.completions[s.sample_index] = Completion(
            req.prompt_index, s.sample_index, list(req.prompt), s.out_ids, s.logprobs, routing, reason, s.version, meta,
            s.versions)
        req.pending -= 1
        if req.pending == 0 and not req.future.done():
            req.future.set_result(req.completions)

    def _fail_running(self, e: Exception) -> None:
        """A forward failed: fail the requests of every running sequence and reset the batch."""
        for s in self._running:
            if not s.req.future.done():
                s.req.future.set_exception(e)
        self._clear_batch()

    def _clear_batch(self) -> None:
        self._running, self._logits = [], None
        self._decode.clear()

    # ------------------------------------------------------------------ background driver
    @property
    def is_serving(self) -> bool:
        return self._driver is not None and self._driver.is_alive()

    def start(self) -> RolloutEngine:
        """Run ``step()`` on one background thread whenever there is work (what the HTTP server does:
        its handlers ``submit`` and await the futures). Without a driver, ``generate`` steps itself."""
        if self.is_serving:
            return self
        with self._cv:
            self._stopping = False
        self._driver = threading.Thread(target=self._loop, name="k3-rollout-engine", daemon=True)
        self._driver.start()
        return self

    def _has_work(self) -> bool:
        return bool(self._running) or (bool(self._queue) and not self._paused)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._has_work():
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:
                log.exception("rollout engine step failed; the running requests were failed")
            with self._cv:
                self._cv.notify_all()  # a weight update may be waiting for the batch to drain

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the driver after its current step; waiting requests fail with ``EngineStopped``."""
        with self._cv:
            self._stopping = True
            waiting, self._queue = list(self._queue), deque()
            self._cv.notify_all()
        if self._driver is not None:
            self._driver.join(timeout)
        with self._model_lock:
            self._fail_running(EngineStopped("the rollout engine stopped"))
        for s in waiting:
            if not s.req.future.done():
                s.req.future.set_exception(EngineStopped("the rollout engine stopped before this request ran"))

    @contextmanager
    def driving(self):
        """A background driver for the length of the block (unless one runs already), then back to
        ``generate`` stepping itself: for many callers at once (agent episodes, a thread each), one
        thread stepping the batch beats every caller stepping it in turn."""
        if self.is_serving:
            yield self
            return
        self.start()
        try:
            yield self
        finally:
            self.stop()
            self.reopen()

    def reopen(self) -> None:
        """Take requests again after ``stop()``, with no driver (``generate`` steps itself): an engine
        served over HTTP for a while (``k3core.rollout.local_server``) goes back to the stages."""
        with self._cv:
            if self.is_serving:
                raise RuntimeError("reopen() while the driver runs: stop() it first")
            self._stopping = False

    # ------------------------------------------------------------------ introspection
    def load(self) -> dict:
        """Running and waiting sequence counts (racy snapshot, for health and overload reporting)."""
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._queue), "max_batch": self.max_batch,
                    "max_queue": self.max_queue, "paused_for_update": bool(self._paused)}

    def release_decode_state(self) -> int:
        """Drop the decode state (the static state and its captured graphs, the dynamic cache, the
        last logits, the sessions' kept states) so its memory returns to the allocator while the engine idles, e.g. during the
        train step that shares its device; the next admission allocates it again. Only between
        batches: refused (``RuntimeError``) while sequences run. Returns the bytes released."""
        with self._model_lock:
            if self._running:
                raise RuntimeError(f"release_decode_state with {len(self._running)} sequences running")
            held = self.decode_state_bytes() + self._kept_bytes
            self._decode.free()
            self._logits = None
            self._kept.clear()
            self._kept_bytes = 0
            return held

    def decode_state_bytes(self) -> int:
        """Bytes of decode state the engine holds now (allocated, whether or not sequences use it):
        the static state's buffers, or the dynamic cache's tensors."""
        with self._model_lock:
            return self._decode.nbytes()

    def cache_stats(self) -> dict:
        """Decode-state bytes of the running batch: KDA (constant per sequence) and MLA (per token)."""
        with self._model_lock:
            B = len(self._running)
            st = self._decode.stats(B)
            return {"batch": B, **st, "kda_bytes_per_seq": st["kda_bytes"] / B if B else 0.0,
                    "mla_bytes_per_seq": st["mla_bytes"] / B if B else 0.0}
