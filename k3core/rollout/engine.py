"""Embedded rollout engine: continuous batching of K3ForCausalLM generation, prefill + cached decode.

The engine knows nothing about tokenization or rewards: token ids in, token ids out, with per-token
log-probabilities, the routed expert ids of every position (for routing replay) and the weight
version that produced them. Stop *strings* need a tokenizer, so they come in as a ``stop_checker``
callback (output ids -> the matched string or None), which the HTTP server builds from its tokenizer.

One request (a prompt, ``SamplingParams``, an optional ``stop_checker``) becomes ``n`` sequences.
Each ``step()``:
1. admits waiting sequences while the batch has room (``max_batch``) and no weight update is
   pending: the joiners' distinct prompts are prefilled together (left-padded), their ``K3Cache``
   rows are appended to the running cache (``K3Cache.concat``: KDA state and conv tails per row, MLA
   latents left-padded with invalid positions), so queued requests join without the batch draining;
2. samples one token for every running sequence from its last logits (per-row temperature, top-k,
   top-p; per-sequence ``torch.Generator``), then retires the sequences that stopped (stop token,
   stop string, ``max_new_tokens``): their cache rows are dropped and a request's future resolves
   once all its samples are done;
3. feeds the survivors' tokens through one decode forward (constant KDA state per sequence, MLA
   attention in latent space against the cache).

Decode modes (``decode=``). "dynamic": the running ``K3Cache`` is reshaped as above (concat, drop,
trim) and each step is an ordinary forward. "static": after prefill each sequence's state is copied
into its slot of a fixed-shape ``StaticDecodeState`` (running sequence j sits in slot j; when
sequences leave, the last ones move into the holes), the batch is padded up to a bucket (1, 2, 4,
... up to ``max_batch``) and each step is ``K3ForCausalLM.decode_step``: fixed shapes, fixed
storage, no host sync. The state grows (slots to the next bucket, length to the next power of two
that holds every running sequence's prompt + ``max_new_tokens``) when admission needs it. "graph":
"static" with each bucket's step captured once as a CUDA graph and replayed
(``k3core.rollout.decode_graphs``); sampling stays outside the graph. "auto" (default): "dynamic".
"graph" is opt-in until its engine-level GPU test with joins and leaves
(tests/k3core/rollout/test_cuda_graph_decode.py) passes: the modes have parted on a greedy token,
which is either a state bug or a near-tie flipped by run-to-run rounding (the MoE combine's
``index_add_`` is atomic on CUDA, so two eager runs of one step differ too). The test compares the
modes pairwise and reports the top-2 margin at the first differing token and where routing first
parts, which tells the two apart. Speeds and the test's GPU outcomes: docs/results/rollout_decode.md.
W4A8 experts are captured too where their Triton kernel runs (CUDA): it builds its tile table on the
device from the expert counts, sized by the step's shapes (``k3core.ops.w4a8.grouped_mm_triton.device_tiles``);
not yet run on a GPU in graph mode. Weight-only MXFP4 experts (the torch path) read the counts on the
host and cannot be captured. Prefill is the same eager forward in every mode.

Sampling. ``logprobs`` are ``log softmax(logits / temperature)`` of the sampled token, before top-k /
top-p truncation: the distribution the trainer re-computes (temperature 0: greedy, log-probs at
temperature 1). Top-k keeps logits >= the k-th largest; top-p then keeps the smallest prefix of the
top-k-renormalised distribution whose mass reaches ``top_p`` (the crossing token is kept); see
``filter_logits`` (the plain per-row reference) and ``filter_logits_batched`` (what runs). A token is
drawn by inverse CDF from one uniform of the sequence's own CPU generator per step, so a request's
samples depend only on its prompt, its parameters and its seed, never on which requests share the
batch. Sample ``j`` of a request with seed ``s`` uses generator seed ``s + j`` (so sending the same
prompt as ``n`` one-sample requests with seeds ``s, s+1, ...`` gives the same samples; this is what
``RolloutClient`` does against a server). ``generate`` gives prompt ``i`` of a call with seed ``s`` the
request seed ``derive_seed(s, i)``.

Weights and versions. ``load_weights`` checks names, shapes and dtypes of the whole state first and
refuses (``ValueError``, nothing copied, the old version keeps serving) on any mismatch. Otherwise it
pauses admission, lets the running sequences finish on the current weights (queued requests wait),
then copies under the model lock into the existing tensors, recomputes every weight-derived cache in
place (AttnRes ``w * gamma``; the absorbed MLA matrices are views of ``kv_b_proj`` and need nothing),
so captured decode graphs read the new weights (they are dropped and re-captured should any storage
have moved), and publishes the new version,
and admission resumes. So every sequence is produced by exactly one version, the one recorded in its
``Completion.weight_version`` (samples of one request admitted on both sides of an update carry their
own versions).

Threads. ``step()`` may be called directly (``generate`` does when no driver runs) or by one
background driver thread (``start()``), which is what the HTTP server uses: handlers ``submit`` and
await the returned ``concurrent.futures.Future``. ``max_queue`` bounds waiting sequences of
``submit`` (``EngineOverloaded`` beyond it; ``generate`` is not bounded).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from collections.abc import Callable

import torch

from k3core.model import K3Cache, K3ForCausalLM
from k3core.model.cache import StaticDecodeState
from k3core.model.norm import at_least_fp32
from k3core.rollout.decode_graphs import DecodeGraphs, GraphCaptureError, bucket

log = logging.getLogger(__name__)

_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1

StopChecker = Callable[[list[int]], "str | None"]


def derive_seed(base: int, index: int) -> int:
    """A well-mixed 63-bit seed for item ``index`` of a call seeded ``base`` (splitmix64)."""
    z = (int(base) * 0x9E3779B97F4A7C15 + (int(index) + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK63


_FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # weights checked for NaN/inf on update


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None

    def validate(self) -> None:
        errs = []
        if self.max_new_tokens < 1:
            errs.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            errs.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errs.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            errs.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            errs.append(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not 0 <= int(self.seed) <= _MASK63:
            errs.append(f"seed must be in [0, 2^63), got {self.seed}")
        if errs:
            raise ValueError("invalid sampling parameters: " + "; ".join(errs))


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    routing: torch.Tensor | None  # [len(prompt)+len(output)-1, n_moe, k] int16, prompt positions first
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int = 0
    # "matched": the stop token id or stop string; "admitted_step"/"finished_step": engine steps;
    # "logits": [len(output), V] rows sampled from, fp32 or wider (only with record_logits)
    meta: dict = field(default_factory=dict)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full: retry later (the HTTP server answers 503)."""


class EngineStopped(RuntimeError):
    """The engine's driver was stopped before the request finished."""


# ------------------------------------------------------------------ sampling
def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Reference: mask (to -inf) everything outside the top-k and outside the smallest set whose
    probability reaches top_p (the token that crosses top_p is kept). logits ``[B, V]`` fp32, one
    top_k / top_p for all rows."""
    out = logits.clone()
    if top_k and top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def filter_logits_batched(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``filter_logits`` with one top_k (``[B]`` int, 0 = off) and top_p (``[B]`` float, 1 = off) per
    row, in one sort. logits ``[B, V]`` fp32 -> ``[B, V]``."""
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < V), top_k, torch.full_like(top_k, V)).to(torch.long)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    drop_sorted = sorted_logits < kth
    probs = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs
    drop_sorted |= (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row the first token whose cumulative probability exceeds ``u * total``.
    probs ``[B, V]`` (>= 0, need not be normalised), u ``[B]`` in [0, 1) -> token ids ``[B]``.
    A zero-probability token is never drawn (the CDF is flat across it)."""
    cdf = probs.double().cumsum(-1)
    x = (u.double().to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    tok = torch.searchsorted(cdf, x, right=True).squeeze(1)
    # u == 1 (never from torch.rand, but rounding can put x at the total): the last possible token
    V = probs.shape[-1]
    last = V - 1 - (probs > 0).flip(-1).to(torch.int8).argmax(-1)
    return torch.where(tok >= V, last, tok)


def sample_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> tuple[int, float]:
    """One row, plainly: (token, logprob) for logits ``[V]`` and the uniform ``u`` (tests only)."""
    if temperature == 0:
        tok = int(logits.argmax())
        return tok, float(torch.log_softmax(logits.double(), -1)[tok])
    scaled = logits.double() / temperature
    probs = torch.softmax(filter_logits(scaled.unsqueeze(0), top_k, top_p)[0], -1)
    target, acc = u * float(probs.sum()), 0.0
    tok = len(probs) - 1
    for i, p in enumerate(probs.tolist()):
        acc += p
        if acc > target:
            tok = i
            break
    return tok, float(torch.log_softmax(scaled, -1)[tok])


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


class RolloutEngine:
    """Continuous-batching generation around an inference model (see the module docstring).

    ``model``: a ``K3ForCausalLM`` (float or W4A8 experts), taken over: eval mode, inference caches on.
    ``max_batch``: most sequences decoded together; ``max_queue``: most waiting sequences ``submit``
    accepts; ``record_logits``: keep every sampled-from logits row in ``Completion.meta`` (tests);
    ``decode``: "auto", "dynamic", "static" or "graph" (see the module docstring; ``cuda_graphs=False``
    is "dynamic")."""

    DECODE_MODES = ("auto", "dynamic", "static", "graph")

    def __init__(self, model: K3ForCausalLM, weight_version: int = 0, max_batch: int = 256, max_queue: int = 4096,
                 record_logits: bool = False, decode: str = "auto"):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch}, {max_queue}")
        if decode not in self.DECODE_MODES:
            raise ValueError(f"decode must be one of {self.DECODE_MODES}, got {decode!r}")
        self.model = model.eval()
        self.model.use_inference_caches = True
        self.model.refresh_inference_caches()
        self.weight_version = weight_version
        self.config = model.config
        self.max_batch, self.max_queue, self.record_logits = max_batch, max_queue, record_logits
        pad = getattr(self.config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < self.config.vocab_size else 0
        self.device = next(model.parameters()).device
        self.decode_mode = self._resolve_decode(decode)
        self._decode_requested = decode
        self.steps = 0
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "admitted": 0, "max_running": 0}
        self._queue: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._cache: K3Cache | None = None
        self._logits: torch.Tensor | None = None  # [len(running), V] fp32: next-token logits
        self._static: StaticDecodeState | None = None  # static/graph modes: running[j] in slot j
        self._graphs: DecodeGraphs | None = None
        self._paused = 0  # weight updates waiting: no admission
        self._cv = threading.Condition()  # queue, pause flag, driver wake-ups (held briefly)
        self._model_lock = threading.RLock()  # model weights and the running batch (held per step)
        self._update_lock = threading.Lock()
        self._driver: threading.Thread | None = None
        self._stopping = False

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
    def load_weights(self, state_dict: dict[str, torch.Tensor], weight_version: int, refresh: bool = True) -> None:
        """Swap in new weights as ``weight_version``: checked first (nothing applied on a mismatch),
        then applied between requests (running sequences finish on the old weights first) with every
        derived cache recomputed. ``refresh=False`` exists only so a test can show what a stale AttnRes
        cache does."""
        self.check_state(state_dict)
        with self._update_lock:
            with self._cv:
                self._paused += 1
            try:
                self._drain()
                with self._model_lock:
                    own = self.model.state_dict(keep_vars=True)
                    for k, t in state_dict.items():
                        own[k].copy_(t)
                    if refresh:
                        self.model.refresh_inference_caches()
                    if self._graphs is not None and self._graphs.weights_moved():
                        self._graphs = None  # re-captured on the next step, reading the new storage
                    self.weight_version = weight_version
            finally:
                with self._cv:
                    self._paused -= 1
                    self._cv.notify_all()

    def _resolve_decode(self, decode: str) -> str:
        from k3core.ops.w4a8 import triton_available
        from k3core.rollout.quantized import expert_format

        fmt = expert_format(self.model)
        # W4A8 experts: the Triton kernel's tile table is built on the device (no host read of the
        # counts); weight-only MXFP4 (w4a16) runs the torch path, which reads them
        capturable = fmt in ("bf16", "none") or (fmt == "w4a8" and self.device.type == "cuda" and triton_available())
        if decode == "auto":  # "graph" once its engine-level GPU test passes (module docstring)
            return "dynamic"
        if decode == "graph" and self.device.type != "cuda":
            raise ValueError(f"decode='graph' needs a CUDA model (this one is on {self.device}); use 'static' or 'dynamic'")
        if decode == "graph" and not capturable:
            raise ValueError(f"decode='graph' cannot capture {fmt} experts here (they need the W4A8 Triton kernel on "
                             "CUDA, which tiles on the device); use 'static' or 'dynamic'")
        return decode

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
                    bounded: bool = True, prompt_indices: list[int] | None = None) -> list[Future]:
        """Queue requests (all or none); each future resolves to its ``n`` Completions in sample order.
        ``bounded``: refuse (``EngineOverloaded``) when the queue would exceed ``max_queue``."""
        built = []
        for i, (prompt, params, checker) in enumerate(requests):
            params.validate()
            p = self._check_prompt(prompt)
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            req = _Request(p, params, checker, Future(), prompt_indices[i] if prompt_indices else 0,
                           [None] * params.n, params.n)
            seqs = [_Seq(req, j, torch.Generator(device="cpu").manual_seed((seed + j) & _MASK63))
                    for j in range(params.n)]
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
                 first_index: int = 0) -> list[Completion]:
        """Blocking batch generation: ``n`` Completions per prompt, ordered (prompt, sample). Prompt
        ``i`` gets request seed ``derive_seed(params.seed, first_index + i)``, so the prompts of a
        larger call generated as consecutive shards (``first_index``: the shard's first position)
        get that call's samples. ``pad_id`` is accepted for compatibility: pads are neutral, so
        their id never changes a result."""
        params.validate()
        if not prompts:
            raise ValueError("every prompt needs at least one token (prompts: non-empty lists of token ids)")
        base = params.seed if params.seed is not None else secrets.randbits(63)
        reqs = [(p, replace(params, seed=derive_seed(base, first_index + i)), None) for i, p in enumerate(prompts)]
        futures = self.submit_many(reqs, bounded=False, prompt_indices=list(range(len(prompts))))
        while not all(f.done() for f in futures):
            if self.is_serving:
                for f in futures:  # the driver resolves them; errors re-raise below
                    f.exception()
            elif not self.step():
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
        """Admit, sample one token per running sequence, retire, decode. False when idle."""
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
        self._running.extend(take)  # before prefill, so a failure fails them too
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
        if len(prompts) != len(take):  # n samples of one prompt share its prefill
            idx = torch.tensor(rows, device=self.device)
            cache, logits = cache.index_select(idx), logits.index_select(0, idx)
        for s, r in zip(take, rows):
            s.prompt_routing = routing[r, P - len(s.req.prompt):].clone()
            s.version, s.admitted_step = self.weight_version, self.steps
        n_old = len(self._running) - len(take)
        if self.decode_mode == "dynamic":
            self._cache = cache if n_old == 0 else K3Cache.concat([self._cache, cache])
        else:
            self._fit_static(n_old)
            self._static.load(cache, list(range(n_old, len(self._running))))
        self._logits = logits if n_old == 0 else torch.cat([self._logits, logits])
        self.stats["prefill_tokens"] += int(mask.sum())
        self.stats["admitted"] += len(take)
        self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        return True

    def _fit_static(self, n_held: int) -> None:
        """Make the static state hold every running sequence (slots and length), keeping the first
        ``n_held`` slots; a new state means new graphs."""
        need_slots = bucket(len(self._running), self.max_batch)
        need_len = max(len(s.req.prompt) + s.req.params.max_new_tokens for s in self._running)
        st = self._static
        if st is not None and st.slots >= need_slots and st.max_len >= need_len:
            return
        max_len = max(64, 1 << (need_len - 1).bit_length(), st.max_len if st else 0)
        slots = max(need_slots, st.slots if st else 0)
        if st is None:
            self._static = StaticDecodeState(self.config, slots, max_len, self.model.lm_head.weight.dtype, self.device)
        else:
            self._static = st.resized(slots, max_len, n_held)
        self._graphs = DecodeGraphs(self.model, self._static) if self.decode_mode == "graph" else None

    def _compact(self, keep: list[int]) -> list[int]:
        """Static modes: the survivors ``keep`` (running indices, ascending) take slots 0..n-1; the
        ones beyond move into the holes. Returns the old running index of each new slot."""
        n = len(keep)
        kept = set(keep)
        order = list(range(n))
        holes = [j for j in range(n) if j not in kept]
        movers = [j for j in keep if j >= n]
        for h, m in zip(holes, movers):
            order[h] = m
        self._static.move(movers, holes)
        self._static.release(n)
        return order

    def _decode_static(self, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tok ``[n]`` (slots 0..n-1) -> (next logits ``[n, V]`` fp32 or wider, routed ids ``[n, n_moe, k]``)."""
        n = tok.shape[0]
        b = bucket(n, self._static.slots)
        self._static.tokens[:n].copy_(tok)
        logits = None
        if self._graphs is not None:
            try:
                logits, routing = self._graphs.replay(b)
            except GraphCaptureError:
                if self._decode_requested == "graph":
                    raise
                log.warning("CUDA graph capture failed; decoding eagerly (decode='static') from now on", exc_info=True)
                self._graphs, self.decode_mode = None, "static"
        if logits is None:
            logits, routing = self.model.decode_step(self._static, b)
        out = at_least_fp32(logits[:n])
        if out.data_ptr() == logits.data_ptr():  # graph outputs are overwritten by the next replay
            out = out.clone()
        return out, routing[:n]

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits ``[B, V]`` (fp32; fp64 for an fp64 model) of the running sequences -> (tokens ``[B]``,
        logprobs ``[B]``)."""
        ps = [s.req.params for s in self._running]
        dev = logits.device
        temp = torch.tensor([p.temperature for p in ps], dtype=logits.dtype, device=dev)
        greedy = temp == 0
        argmax = logits.argmax(-1)
        if bool(greedy.all()):
            return argmax, torch.log_softmax(logits, -1).gather(1, argmax.unsqueeze(1)).squeeze(1)
        scaled = logits / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)
        logp = torch.log_softmax(scaled, -1)
        top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in ps], dtype=logits.dtype, device=dev)
        if bool((top_k > 0).any() or (top_p < 1).any()):
            scaled = filter_logits_batched(scaled, top_k, top_p)
        probs = torch.softmax(scaled, -1)
        # one uniform per sampling sequence from its own generator: batch composition never matters
        u = torch.tensor([0.0 if p.temperature == 0 else float(torch.rand((), generator=s.gen, dtype=torch.float64))
                          for p, s in zip(ps, self._running)], dtype=torch.float64)
        tok = torch.where(greedy, argmax, sample_from_probs(probs, u))
        return tok, logp.gather(1, tok.unsqueeze(1)).squeeze(1)

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
        tok, lp = self._sample(logits)
        toks, lps = tok.tolist(), lp.tolist()
        keep = []
        for j, s in enumerate(self._running):
            s.out_ids.append(toks[j])
            s.logprobs.append(lps[j])
            if self.record_logits:
                s.logits.append(logits[j].cpu())
            fin = self._finish(s, toks[j])
            if fin is None:
                keep.append(j)
            else:
                self._complete(s, *fin)
        self.steps += 1
        self.stats["decode_tokens"] += len(toks)
        if not keep:
            self._clear_batch()
            return
        if len(keep) < len(self._running):
            if self._static is not None:
                keep = self._compact(keep)
            idx = torch.tensor(keep, device=self.device)
            if self._static is None:
                self._cache = self._cache.index_select(idx).trim()
            self._running = [self._running[j] for j in keep]
            tok = tok.index_select(0, idx)
        B = len(self._running)
        if self._static is not None:
            self._logits, routing = self._decode_static(tok)
        else:
            out = self.model(tok.view(B, 1), torch.ones(B, 1, dtype=torch.bool, device=self.device),
                             cache=self._cache, return_routing=True)
            self._logits, routing = at_least_fp32(out.logits[:, -1]), out.routing[:, 0]
        r = routing.to(torch.int16).cpu()
        for j, s in enumerate(self._running):
            s.routes.append(r[j])

    def _complete(self, s: _Seq, reason: str, matched) -> None:
        req = s.req
        n_moe = s.prompt_routing.shape[1]
        k = s.prompt_routing.shape[2]
        gen_routes = torch.stack(s.routes) if s.routes else torch.zeros(0, n_moe, k, dtype=torch.int16)
        meta = {"matched": matched, "admitted_step": s.admitted_step, "finished_step": self.steps}
        if self.record_logits:
            meta["logits"] = torch.stack(s.logits)
        req.completions[s.sample_index] = Completion(
            req.prompt_index, s.sample_index, list(req.prompt), s.out_ids, s.logprobs,
            torch.cat([s.prompt_routing, gen_routes]), reason, s.version, meta)
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
        self._running, self._cache, self._logits = [], None, None
        if self._static is not None:
            self._static.release(0)

    # ------------------------------------------------------------------ background driver
    @property
    def is_serving(self) -> bool:
        return self._driver is not None and self._driver.is_alive()

    def start(self) -> RolloutEngine:
        """Run ``step()`` on one background thread whenever there is work."""
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

    # ------------------------------------------------------------------ introspection
    def load(self) -> dict:
        """Running and waiting sequence counts (racy snapshot, for health and overload reporting)."""
        with self._cv:
            return {"running": len(self._running), "waiting": len(self._queue), "max_batch": self.max_batch,
                    "max_queue": self.max_queue, "paused_for_update": bool(self._paused)}

    def release_decode_state(self) -> int:
        """Drop the decode state (the static state and its captured graphs, the dynamic cache, the
        last logits) so its memory returns to the allocator while the engine idles, e.g. during the
        train step that shares its device; the next admission allocates it again. Only between
        batches: refused (``RuntimeError``) while sequences run. Returns the bytes released."""
        with self._model_lock:
            if self._running:
                raise RuntimeError(f"release_decode_state with {len(self._running)} sequences running")
            held = self.decode_state_bytes()
            self._static, self._graphs, self._cache, self._logits = None, None, None, None
            return held

    def decode_state_bytes(self) -> int:
        """Bytes of decode state the engine holds now (allocated, whether or not sequences use it):
        the static state's buffers, or the dynamic cache's tensors."""
        with self._model_lock:
            if self._static is not None:
                return sum(t.numel() * t.element_size() for t in self._static.buffers())
            c = self._cache
            return (c.kda_nbytes() + c.mla_nbytes()) if c is not None else 0

    def cache_stats(self) -> dict:
        """Decode-state bytes of the running batch: KDA (constant per sequence) and MLA (per token)."""
        with self._model_lock:
            if self._static is not None:
                B = len(self._running)
                st = self._static.stats(B)
                return {"batch": B, **st, "kda_bytes_per_seq": st["kda_bytes"] / B if B else 0.0,
                        "mla_bytes_per_seq": st["mla_bytes"] / B if B else 0.0}
            c = self._cache
            B = c.batch_size if c is not None else 0
            return {"batch": B, "kda_bytes": c.kda_nbytes() if c else 0, "mla_bytes": c.mla_nbytes() if c else 0,
                    "kda_bytes_per_seq": c.kda_nbytes() / B if B else 0.0,
                    "mla_bytes_per_seq": c.mla_nbytes() / B if B else 0.0}
