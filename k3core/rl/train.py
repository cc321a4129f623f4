"""One RL train step (GRPO + TIS, optional routing replay) and the supervised warm-up step.

Sequences arrive as token lists (prompt, completion) with per-token rollout log-probabilities, a
sequence advantage and, for routing replay, the expert ids the rollout engine chose at every input
position. They are right-padded into ``[B, L]`` with ``L = max(len(prompt) + len(completion)) - 1``:
inputs are ``seq[:-1]``, targets ``seq[1:]``, and only targets that are generated tokens are trained.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import pyarrow as pa
import torch

from k3core.model import K3ForCausalLM
from k3core.rl.grpo import grpo_loss, masked_entropy
from k3core.settings import GRPOSettings


@dataclass
class RLSequence:
    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logprobs: list[float] | None = None
    advantage: float = 0.0
    routing: torch.Tensor | None = None  # [len(prompt)+len(output)-1, n_moe, k]


def pack_sequences(seqs: list[RLSequence], pad_id: int, with_routing: bool = False) -> dict[str, torch.Tensor]:
    B = len(seqs)
    if B == 0:
        raise ValueError("empty batch: no sequences to train on")
    full = [s.prompt_ids + s.output_ids for s in seqs]
    if any(len(s.output_ids) == 0 for s in seqs):
        raise ValueError("a sequence has an empty completion: nothing to train on for it")
    if any(len(s.prompt_ids) == 0 for s in seqs):  # no position would predict the first generated token
        raise ValueError("a sequence has an empty prompt: it needs at least one token (BOS) before the completion")
    L = max(len(f) for f in full) - 1
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    tgt = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    gen = torch.zeros(B, L, dtype=torch.bool)
    lp_roll = torch.zeros(B, L)
    adv = torch.zeros(B)
    routing = None
    for b, (s, f) in enumerate(zip(seqs, full)):
        n = len(f) - 1
        ids[b, :n] = torch.tensor(f[:-1])
        tgt[b, :n] = torch.tensor(f[1:])
        valid[b, :n] = True
        p = len(s.prompt_ids)
        gen[b, p - 1:n] = True
        if s.rollout_logprobs is not None:
            if len(s.rollout_logprobs) != len(s.output_ids):
                raise ValueError(f"sequence {b}: {len(s.rollout_logprobs)} rollout logprobs for {len(s.output_ids)} tokens")
            lp_roll[b, p - 1:n] = torch.tensor(s.rollout_logprobs)
        adv[b] = s.advantage
    if with_routing:
        first = next((s.routing for s in seqs if s.routing is not None), None)
        if first is None:
            raise ValueError("routing replay: no sequence carries routing (rollouts must record the experts they used)")
        k_shape = first.shape[1:]
        routing = torch.arange(k_shape[1]).expand(B, L, *k_shape).clone()
        for b, (s, f) in enumerate(zip(seqs, full)):
            n = len(f) - 1
            if s.routing is None or s.routing.shape[0] != n:
                got = None if s.routing is None else tuple(s.routing.shape)
                raise ValueError(f"routing replay: sequence {b} has routing {got}, needs {n} positions")
            routing[b, :n] = s.routing.long()
    return {"input_ids": ids, "targets": tgt, "valid": valid, "gen_mask": gen, "rollout_logprobs": lp_roll,
            "advantages": adv, "routing": routing}


def grpo_train_step(model: K3ForCausalLM, optimizer: torch.optim.Optimizer, seqs: list[RLSequence],
                    cfg: GRPOSettings, pad_id: int, temperature: float = 1.0) -> dict:
    """One optimizer step on a batch. The first (only) update is on-policy, so ``logp_old`` is the
    detached current ``logp``; TIS corrects the rollout engine's mismatch."""
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    batch = pack_sequences(seqs, pad_id, with_routing=cfg.routing_replay)
    model.train()
    model.use_inference_caches = False
    out = model(batch["input_ids"].to(dev), batch["valid"].to(dev),
                forced_routing=None if batch["routing"] is None else batch["routing"].to(dev))
    logits = out.logits.float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, batch["targets"].to(dev).unsqueeze(-1)).squeeze(-1)
    mask = batch["gen_mask"].to(dev)
    loss, st = grpo_loss(logp, logp.detach(), batch["rollout_logprobs"].to(dev), batch["advantages"].to(dev),
                         mask, cfg.clip_eps_low, cfg.clip_eps_high, cfg.tis_cap)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                                     cfg.max_grad_norm))
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm {grad_norm}: the step was not applied")
    optimizer.step()
    dt = time.perf_counter() - t0
    m = asdict(st)
    m.update(grad_norm=grad_norm, entropy=masked_entropy(logits, mask), train_seconds=dt,
             train_tokens_per_s=float(batch["valid"].sum()) / dt)
    return m


def sft_step(model: K3ForCausalLM, optimizer: torch.optim.Optimizer, seqs: list[RLSequence], pad_id: int,
             max_grad_norm: float = 1.0) -> dict:
    """Supervised step on (prompt, reference completion): mean NLL of the completion tokens."""
    dev = next(model.parameters()).device
    batch = pack_sequences(seqs, pad_id)
    model.train()
    model.use_inference_caches = False
    out = model(batch["input_ids"].to(dev), batch["valid"].to(dev), targets=batch["targets"].to(dev),
                loss_mask=batch["gen_mask"].to(dev), return_logits=False)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    gn = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_grad_norm))
    optimizer.step()
    return {"loss": float(out.loss), "grad_norm": gn}


def table_to_sequences(table: pa.Table, n_moe: int, top_k: int) -> list[RLSequence]:
    seqs = []
    for r in table.to_pylist():
        routing = torch.tensor(r["routing"], dtype=torch.int16).view(-1, n_moe, top_k) if n_moe else None
        seqs.append(RLSequence(r["prompt_ids"], r["output_ids"], r["logprobs"], r["advantage"], routing))
    return seqs


def train_on_table(model: K3ForCausalLM, optimizer: torch.optim.Optimizer, table: pa.Table, cfg: GRPOSettings,
                   pad_id: int, temperature: float = 1.0) -> dict:
    """One GRPO step over the whole scored batch (sequences with zero advantage carry no signal and
    are skipped; a batch where every group is uniform is a no-op step)."""
    n_moe, k = len(model.moe_layer_ids), model.config.num_experts_per_token
    seqs = [s for s in table_to_sequences(table, n_moe, k) if s.advantage != 0.0]
    if not seqs:
        return {"skipped": 1.0, "sequences": 0}
    m = grpo_train_step(model, optimizer, seqs, cfg, pad_id, temperature)
    m["sequences"] = len(seqs)
    m["skipped"] = 0.0
    return m
