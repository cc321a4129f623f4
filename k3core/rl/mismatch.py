"""Train/inference mismatch: how far a rollout engine's token distributions are from the trainer's.

Owns: scoring the same rollouts (token ids) with the trainer (one full forward over prompt and
completion, as the train step runs it) and with an engine (its own runtime path: prefill of the
prompt, then cached one-token decode, feeding the rollout's tokens instead of sampling), and the
divergences between the two at every generated position. Does not own: sampling (the rollouts are
given), the engines' arithmetic.

Per generated position t, with p = trainer and q = engine distributions at temperature tau
(``log_softmax(logits / tau)``, the distribution the rollout sampled from and the trainer scores):
- ``kl``: the exact KL(p || q) = sum_v p(v) (log p(v) - log q(v)) over the whole vocabulary, the
  headline figure (needs no sampling assumption, so it is exact for any engine on any tokens);
- ``k3``: the sampled-token estimator GRPO logs (``k3core.rl.grpo``), k3 = (r - 1) - log r with
  r = p(x_t) / q(x_t) at the rollout's token x_t. Over tokens drawn from q its mean is KL(q || p)
  (the reverse direction); it is unbiased only for the engine that sampled the rollouts;
- ``k3_pq``: r log r - (r - 1), whose mean over tokens drawn from q is KL(p || q), the sampled
  counterpart of ``kl`` (same caveat);
- ``logprob_abs_diff``: mean |log p(x_t) - log q(x_t)|.
All are means over generated tokens (every token weighs the same, as in the token-level GRPO loss);
``kl_median`` and ``kl_max`` show how heavy the tail is (a flipped expert choice moves one position a lot).
Log-softmax runs in fp64 on the models' logits: with fp32 log-probabilities the first-order terms
sum_v p(v) * (rounding error of log p(v) - log q(v)) no longer cancel and leave a floor of ~1e-7
on the KL, above the float engine's true mismatch.

``measure_mismatch`` builds the two engines the issue compares from one trainer model: the W4A8
engine (MXFP4 routed experts, FP8 activations) and a float engine with the trainer's own weights and
dtype, which differs from the trainer only by runtime path (cached decode vs full forward, KDA
recurrent vs chunked, the AttnRes ``w * gamma`` cache), and reports both and their ratio.
"""

from __future__ import annotations

import copy

import torch

from k3core.model import K3Cache, K3ForCausalLM
from k3core.rl.train import RLSequence, pack_sequences

__all__ = ["engine_logprobs", "trainer_logprobs", "divergences", "rollout_mismatch", "measure_mismatch"]


@torch.no_grad()
def engine_logprobs(model: K3ForCausalLM, seqs: list[tuple[list[int], list[int]]], pad_id: int,
                    temperature: float = 1.0, decode: str = "dynamic") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The engine's distributions along given rollouts, through its decode path.

    ``seqs``: (prompt ids, completion ids) pairs; ``model`` an engine model (inference caches on, as
    ``RolloutEngine`` sets it). Prompts are left-padded and prefilled, then completion tokens are fed
    one per step (finished sequences are fed ``pad_id``; causal, so earlier positions do not see it)
    through the decode path the engine runs in ``decode`` mode: "dynamic", an ordinary forward with
    the ``K3Cache``; "static", ``K3ForCausalLM.decode_step`` on a fixed-shape ``StaticDecodeState``
    (the batch padded to a power of two); "graph", that step replayed as a CUDA graph
    (``k3core.rollout.decode_graphs``; CUDA only). Returns per sequence fp64 log-probabilities
    ``[len(completion), V]`` on the model's device, and the routed expert ids of its input positions
    ``[len(prompt) + len(completion) - 1, n_moe, k]`` on the host (what routing replay would send the
    trainer; read back once, after the last step, not once per step)."""
    if not model.use_inference_caches:
        raise ValueError("engine_logprobs needs an engine model (use_inference_caches on, caches refreshed)")
    if decode not in ("dynamic", "static", "graph"):
        raise ValueError(f"decode must be dynamic, static or graph, got {decode!r}")
    dev = next(model.parameters()).device
    B, P = len(seqs), max(len(p) for p, _ in seqs)
    T = max(len(o) for _, o in seqs)
    if min(len(o) for _, o in seqs) == 0 or min(len(p) for p, _ in seqs) == 0:
        raise ValueError("every rollout needs a non-empty prompt and completion")
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.bool)
    for b, (p, _) in enumerate(seqs):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = True
    cache = K3Cache.empty(model.config)
    out = model(ids.to(dev), mask.to(dev), cache=cache, return_routing=True)
    steps = [torch.log_softmax(out.logits[:, -1].double() / temperature, -1)]
    routes = [out.routing]
    feed = torch.tensor([[o[t] if t < len(o) else pad_id for _, o in seqs] for t in range(T - 1)],
                        dtype=torch.long, device=dev).reshape(T - 1, B)
    if decode == "dynamic":
        for t in range(T - 1):
            out = model(feed[t].unsqueeze(1), torch.ones(B, 1, dtype=torch.bool, device=dev), cache=cache,
                        return_routing=True)
            steps.append(torch.log_softmax(out.logits[:, -1].double() / temperature, -1))
            routes.append(out.routing)
    else:
        from k3core.model.cache import StaticDecodeState
        from k3core.rollout.decode_graphs import DecodeGraphs

        b = 1 << (B - 1).bit_length()  # the engine's bucket for B sequences
        state = StaticDecodeState(model.config, b, max(64, 1 << (P + T - 1).bit_length()),
                                  model.lm_head.weight.dtype, dev)
        state.load(cache, list(range(B)))
        graphs = DecodeGraphs(model, state) if decode == "graph" else None
        for t in range(T - 1):
            state.tokens[:B].copy_(feed[t])
            logits, routing = graphs.replay(b) if graphs is not None else model.decode_step(state, b)
            steps.append(torch.log_softmax(logits[:B].double() / temperature, -1))  # a new tensor: replay may overwrite
            routes.append(routing[:B].unsqueeze(1).clone())
    lp = torch.stack(steps, 1)  # [B, T, V], on the device: the divergences are taken there
    routing = torch.cat([r.to(routes[0].dtype) for r in routes], 1).cpu()  # [B, P + T - 1, n_moe, k]
    lps, rts = [], []
    for b, (p, o) in enumerate(seqs):
        lps.append(lp[b, :len(o)])
        rts.append(routing[b, P - len(p):P + len(o) - 1])
    return lps, rts


@torch.no_grad()
def trainer_logprobs(model: K3ForCausalLM, seqs: list[tuple[list[int], list[int]]], pad_id: int,
                     temperature: float = 1.0, routing: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The trainer's distributions at the completion positions: one full forward over right-padded
    ``prompt + completion[:-1]`` (``k3core.rl.train.pack_sequences``, as the train step), no inference
    caches; ``routing`` (per sequence, as ``engine_logprobs`` returns it) replays the engine's expert
    choice. Returns per sequence fp64 ``[len(completion), V]``."""
    rl = [RLSequence(list(p), list(o), routing=None if routing is None else routing[b])
          for b, (p, o) in enumerate(seqs)]
    batch = pack_sequences(rl, pad_id, with_routing=routing is not None)
    dev = next(model.parameters()).device
    was_training, was_cached = model.training, model.use_inference_caches
    model.eval()
    model.use_inference_caches = False
    try:
        out = model(batch["input_ids"].to(dev), batch["valid"].to(dev),
                    forced_routing=None if batch["routing"] is None else batch["routing"].to(dev))
    finally:
        model.train(was_training)
        model.use_inference_caches = was_cached
    lp = torch.log_softmax(out.logits.double() / temperature, -1)  # on the device, as the engine's
    return [lp[b, len(p) - 1:len(p) - 1 + len(o)] for b, (p, o) in enumerate(seqs)]


def divergences(lp_trainer: list[torch.Tensor], lp_engine: list[torch.Tensor], tokens: list[list[int]],
                masks: list | None = None) -> dict:
    """Token-mean divergences (see the module docstring) from per-sequence ``[T_b, V]`` log-probs,
    computed on the device the trainer's log-probs are on (a GPU keeps the ``[tokens, V]`` fp64
    tensors there; only the scalars come back, in one read). ``masks``: per sequence, a loss mask
    (or None: every token): only the model's own tokens count (an agentic trajectory's tool results
    and user turns were never sampled, so a mismatch there is not the policy's)."""
    p = torch.cat(lp_trainer).double()
    q = torch.cat(lp_engine).double().to(p.device)
    x = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=p.device)
    if p.shape != q.shape or p.shape[0] != x.shape[0]:
        raise ValueError(f"log-prob shapes {tuple(p.shape)} and {tuple(q.shape)} for {x.shape[0]} tokens")
    if masks is not None and any(m is not None for m in masks):
        keep = torch.tensor([bool(v) for m, seq in zip(masks, tokens) for v in (m if m is not None else [1] * len(seq))],
                            device=p.device)
        p, q, x = p[keep], q[keep], x[keep]
    # >= 0 up to rounding; in row chunks: each [rows, V] fp64 temporary is 1.3 GB at V = 163,840
    kl = torch.cat([(pc.exp() * (pc - qc)).sum(-1) for pc, qc in zip(p.split(1024), q.split(1024))]).clamp_min(0.0)
    log_r = (p.gather(1, x[:, None]) - q.gather(1, x[:, None])).squeeze(1)
    r = log_r.exp()
    names = ("kl", "kl_median", "kl_max", "k3", "k3_pq", "logprob_abs_diff")
    values = torch.stack([kl.mean(), kl.median(), kl.max(), (r - 1 - log_r).mean(), (r * log_r - (r - 1)).mean(),
                          log_r.abs().mean()]).tolist()
    return {**dict(zip(names, values)), "tokens": int(x.shape[0])}


def rollout_mismatch(trainer: K3ForCausalLM, engine_model: K3ForCausalLM, seqs: list[tuple[list[int], list[int]]],
                     pad_id: int, temperature: float = 1.0, routing_replay: bool = False, decode: str = "dynamic") -> dict:
    """Divergences between ``trainer`` and ``engine_model`` on the rollouts ``seqs`` (token ids).
    ``routing_replay``: the trainer reuses the engine's expert choice (as the pipeline's train step),
    so only numerics differ, not routing decisions. ``decode``: the engine's decode path (``engine_logprobs``)."""
    lp_e, routes = engine_logprobs(engine_model, seqs, pad_id, temperature, decode)
    lp_t = trainer_logprobs(trainer, seqs, pad_id, temperature, routes if routing_replay else None)
    return divergences(lp_t, lp_e, [o for _, o in seqs])


def _engine_copy(trainer: K3ForCausalLM, quantized: bool, act_granularity: str | None) -> K3ForCausalLM:
    from k3core.rollout.engine import RolloutEngine
    from k3core.rollout.quantized import quantize_engine_model

    model = copy.deepcopy(trainer)
    if quantized:
        quantize_engine_model(model, act_granularity)
    return RolloutEngine(model).model  # eval, inference caches on and refreshed


def measure_mismatch(trainer: K3ForCausalLM, seqs: list[tuple[list[int], list[int]]], pad_id: int,
                     temperature: float = 1.0, dtype: torch.dtype | None = torch.bfloat16,
                     act_granularity: str | None = "token", routing_replay: bool = False,
                     decode: str = "dynamic", masks: list | None = None) -> dict:
    """KL(trainer || W4A8 engine) beside KL(trainer || float engine) on the same rollouts, each engine
    scoring them through the decode path of ``decode`` mode (the run's: ``k3core.device.decode_mode``).

    The trainer is cast to ``dtype`` first (a copy; ``None`` keeps its dtype): bf16 by default, the
    issue's "bf16 trainer"; both engines are built from that copy. Returns ``w4a8_*`` and ``bf16_*``
    divergences (``bf16`` names the float engine whatever ``dtype`` is) and ``kl_ratio`` =
    KL(trainer || W4A8) / KL(trainer || float engine) (inf when the latter is exactly 0). ``masks``:
    per sequence, the positions that count (``divergences``)."""
    t = copy.deepcopy(trainer)
    if dtype is not None:
        t.cast(dtype)
    out: dict = {}
    tokens = [o for _, o in seqs]
    # without routing replay the trainer's forward is the same for both engines: run it once
    lp_free = None if routing_replay else trainer_logprobs(t, seqs, pad_id, temperature)
    for name, quantized in (("w4a8", True), ("bf16", False)):
        lp_e, routes = engine_logprobs(_engine_copy(t, quantized, act_granularity), seqs, pad_id, temperature, decode)
        lp_t = lp_free if lp_free is not None else trainer_logprobs(t, seqs, pad_id, temperature, routes)
        for k, v in divergences(lp_t, lp_e, tokens, masks).items():
            out[f"{name}_{k}"] = v
    out["kl_ratio"] = out["w4a8_kl"] / out["bf16_kl"] if out["bf16_kl"] > 0 else float("inf")
    return out
