"""Embedded rollout engine: batched prefill + cached decode of token ids with K3ForCausalLM.

The engine knows nothing about tokenization or rewards: token ids in, token ids out, with per-token
log-probabilities, the routed expert ids of every position (for routing replay) and the weight
version that produced them.

- Prompts are left-padded and prefilled once; decode then runs one token per step against the
  ``K3Cache`` (constant KDA state per sequence, MLA latent per token). Finished sequences leave the
  batch (their cache rows are dropped) so the batch shrinks as samples stop.
- Sampling: temperature, top-k, top-p, stop token ids, max new tokens, n samples per prompt, a seed.
  ``logprobs`` are ``log softmax(logits / temperature)`` of the sampled token (before top-k/top-p
  truncation), the distribution the trainer re-computes.
- Weights change only through ``load_weights`` (in-process transfer): it copies, bumps the version and
  recomputes every weight-derived cache (AttnRes ``w * gamma``) before the next request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3core.model import K3Cache, K3ForCausalLM


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
        if errs:
            raise ValueError("invalid sampling parameters: " + "; ".join(errs))


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    routing: torch.Tensor | None  # [len(prompt)+len(output), n_moe, k] int16, prompt positions first
    finish_reason: str  # "stop" | "length"
    weight_version: int = 0
    meta: dict = field(default_factory=dict)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and outside the smallest set whose probability
    reaches top_p (the token that crosses top_p is kept). logits ``[B, V]`` fp32."""
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


class RolloutEngine:
    def __init__(self, model: K3ForCausalLM, weight_version: int = 0):
        self.model = model.eval()
        self.model.use_inference_caches = True
        self.model.refresh_inference_caches()
        self.weight_version = weight_version
        self.config = model.config

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], weight_version: int, refresh: bool = True) -> None:
        """In-process transfer: copy every tensor (names and shapes checked first, nothing applied on a
        mismatch), then recompute derived caches and publish the version. ``refresh=False`` exists only
        so a test can show what a stale AttnRes cache does."""
        own = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        own = {k: v for k, v in own.items() if not k.endswith("._attn_site.cache") and not k.endswith("_site.cache")}
        missing = sorted(set(own) - set(state_dict))
        extra = sorted(set(state_dict) - set(own))
        if missing or extra:
            raise ValueError(f"weight transfer refused: missing {missing[:3]}, unexpected {extra[:3]}")
        for k, t in state_dict.items():
            if tuple(t.shape) != tuple(own[k].shape):
                raise ValueError(f"weight transfer refused: {k} has shape {tuple(t.shape)}, engine expects {tuple(own[k].shape)}")
        for k, t in state_dict.items():
            own[k].copy_(t)
        if refresh:
            self.model.refresh_inference_caches()
        self.weight_version = weight_version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, pad_id: int) -> list[Completion]:
        params.validate()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (prompts: non-empty lists of token ids)")
        dev = next(self.model.parameters()).device
        seqs = [(i, s, p) for i, p in enumerate(prompts) for s in range(params.n)]
        B, P = len(seqs), max(len(p) for _, _, p in seqs)
        ids = torch.full((B, P), pad_id, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.bool)
        for b, (_, _, p) in enumerate(seqs):
            ids[b, P - len(p):] = torch.tensor(p)
            mask[b, P - len(p):] = True
        ids, mask = ids.to(dev), mask.to(dev)
        gen = torch.Generator(device=dev)
        gen.manual_seed(params.seed if params.seed is not None else torch.seed())
        cache = K3Cache.empty(self.config)
        out = self.model(ids, mask, cache=cache, return_routing=True)
        last = out.logits[:, -1].float()
        routing_prompt = out.routing.to(torch.int16).cpu()
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        out_route: list[list[torch.Tensor]] = [[] for _ in range(B)]
        finish = ["length"] * B
        active = torch.arange(B, device=dev)
        stop = set(params.stop_token_ids)
        for step in range(params.max_new_tokens):
            if params.temperature == 0:
                logp_all = torch.log_softmax(last, -1)
                tok = last.argmax(-1)
            else:
                scaled = last / params.temperature
                logp_all = torch.log_softmax(scaled, -1)
                probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), -1)
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            lp = logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            keep = []
            for j, b in enumerate(active.tolist()):
                t = int(tok[j])
                out_ids[b].append(t)
                out_lp[b].append(float(lp[j]))
                if t in stop:
                    finish[b] = "stop"
                else:
                    keep.append(j)
            if step == params.max_new_tokens - 1 or not keep:
                break
            # the last sampled token of each kept sequence is fed back; its routing is recorded then
            keep_t = torch.tensor(keep, device=dev)
            if len(keep) < len(active):
                cache = cache.index_select(keep_t)
                active, tok = active[keep_t], tok[keep_t]
            out = self.model(tok.unsqueeze(1), torch.ones(len(active), 1, dtype=torch.bool, device=dev),
                             cache=cache, return_routing=True)
            last = out.logits[:, -1].float()
            r = out.routing[:, 0].to(torch.int16).cpu()
            for j, b in enumerate(active.tolist()):
                out_route[b].append(r[j])
        results = []
        n_moe, k = routing_prompt.shape[2], routing_prompt.shape[3]
        for b, (i, s, p) in enumerate(seqs):
            # routing for positions: prompt tokens, then every generated token that was fed back
            rp = routing_prompt[b, P - len(p):]
            rg = torch.stack(out_route[b]) if out_route[b] else torch.zeros(0, n_moe, k, dtype=torch.int16)
            results.append(Completion(i, s, list(p), out_ids[b], out_lp[b], torch.cat([rp, rg]), finish[b], self.weight_version))
        return results
