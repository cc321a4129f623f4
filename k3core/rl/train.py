"""The RL train step (GRPO + PPO clip + TIS, optional routing replay) and the supervised warm-up step.

One train step per rollout batch: ``ppo_epochs`` passes over the batch, each split into
``minibatches`` shuffled minibatches, one optimizer step each; ``logp_old`` is taken once before the
first update. Each minibatch runs as micro-batches under a token budget (``micro_batch_tokens``)
with gradient accumulation: the same code on CPU and GPU, and the same update whatever the split.

Sequences arrive as token lists (prompt, completion) with per-token rollout log-probabilities, a
sequence advantage and, for routing replay, the expert ids the rollout engine chose at every input
position. Inputs are ``seq[:-1]``, targets ``seq[1:]``, and only targets that are generated tokens
are trained: a multi-turn sequence's ``loss_mask`` marks which of its output tokens the policy
sampled, and the tool results and user turns between its turns are context only (every count,
weight and log-probability list of the step is over the sampled tokens). Two layouts of a micro-batch (``GRPOSettings.packing``), one step implementation:
- packed (``pack_varlen``): the sequences back to back in one row ``[1, T]``, T the sum of their
  lengths, with ``cu_seqlens`` offsets; the model computes each as if alone, no position is padding.
  Micro-batches are filled first-fit-decreasing under a budget of real tokens.
- padded (``pack_sequences``): right-padded into ``[B, L]`` with ``L = max(len(prompt) +
  len(completion)) - 1`` and an attention mask; micro-batches hold similar lengths under a budget of
  sequences x L.
Both give the same log-probabilities and gradients up to float rounding (tests/k3core/rl/test_packed_train.py).

Data parallel (``DataParallel``, FSDP2 under torchrun: k3core.rl.fsdp): every rank runs the same
updates and micro-batches and trains on its share of each micro-batch (positions ``rank::world``);
the loss weights are the whole minibatch's and the loss is scaled by ``world``, so the ranks'
gradients averaged by FSDP2's reduce-scatter equal the one-process gradient. Statistics are
gathered from every rank before they are reported.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import pyarrow as pa
import torch

from k3core.device import to_device
from k3core.model import K3ForCausalLM
from k3core.rl.grpo import grpo_loss, mean_entropy
from k3core.settings import GRPOSettings


@dataclass(frozen=True)
class DataParallel:
    """This process's place among ``world`` data-parallel ranks of an initialised process group."""

    rank: int
    world: int

    def share(self, idx: list[int]) -> tuple[list[int], bool]:
        """(this rank's positions of a micro-batch, whether it is a stand-in). Every FSDP2 forward is a
        collective all ranks join, so a rank with no share runs the micro-batch's first sequence at
        zero loss weight (the stand-in) instead of skipping it."""
        mine = idx[self.rank::self.world]
        return (mine, False) if mine else (idx[:1], True)

    def gather(self, obj):
        """``obj`` of every rank, in rank order."""
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def _share(dp: DataParallel | None, idx: list[int]) -> tuple[list[int], bool]:
    return (idx, False) if dp is None else dp.share(idx)


@dataclass
class RLSequence:
    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logprobs: list[float] | None = None
    advantage: float = 0.0
    routing: torch.Tensor | None = None  # [len(prompt)+len(output)-1, n_moe, k]
    ref_logprobs: list[float] | None = None  # the frozen reference's, per trained token (KL penalty)
    # 1 where ``output_ids`` holds a token the policy sampled (trained), 0 where the environment wrote it
    # (a multi-turn episode's tool results and user turns: context only). None: every output token is sampled.
    loss_mask: list[int] | None = None

    def trained(self) -> torch.Tensor:
        """The loss mask as a bool tensor over ``output_ids``."""
        if self.loss_mask is None:
            return torch.ones(len(self.output_ids), dtype=torch.bool)
        return torch.tensor(self.loss_mask, dtype=torch.bool)

    @property
    def n_trained(self) -> int:
        return len(self.output_ids) if self.loss_mask is None else int(sum(self.loss_mask))


def _check_batch(seqs: list[RLSequence]) -> None:
    if not seqs:
        raise ValueError("empty batch: no sequences to train on")
    if any(len(s.output_ids) == 0 for s in seqs):
        raise ValueError("a sequence has an empty completion: nothing to train on for it")
    for b, s in enumerate(seqs):
        if s.loss_mask is not None and (len(s.loss_mask) != len(s.output_ids) or not s.n_trained
                                        or any(m not in (0, 1) for m in s.loss_mask)):
            raise ValueError(f"sequence {b}: its loss mask must be 0/1 for each of its {len(s.output_ids)} output "
                             f"tokens with at least one 1 (a sampled token), got {s.loss_mask!r:.200}")
    if any(len(s.prompt_ids) == 0 for s in seqs):  # no position would predict the first generated token
        raise ValueError("a sequence has an empty prompt: it needs at least one token (BOS) before the completion")


def _check_logprobs(b: int, s: RLSequence, with_ref: bool) -> None:
    if s.rollout_logprobs is not None and len(s.rollout_logprobs) != len(s.output_ids):
        raise ValueError(f"sequence {b}: {len(s.rollout_logprobs)} rollout logprobs for {len(s.output_ids)} tokens")
    if with_ref and (s.ref_logprobs is None or len(s.ref_logprobs) != s.n_trained):
        got = None if s.ref_logprobs is None else len(s.ref_logprobs)
        raise ValueError(f"sequence {b}: {got} reference logprobs for {s.n_trained} trained tokens (every "
                         "sequence of a batch needs them once one has)")


def _check_routing(seqs: list[RLSequence]) -> torch.Size:
    """The ``[n_moe, k]`` shape of the batch's routing, after checking every sequence carries one
    entry per input position."""
    first = next((s.routing for s in seqs if s.routing is not None), None)
    if first is None:
        raise ValueError("routing replay: no sequence carries routing (rollouts must record the experts they used)")
    for b, s in enumerate(seqs):
        n = _input_len(s)
        if s.routing is None or s.routing.shape[0] != n:
            got = None if s.routing is None else tuple(s.routing.shape)
            raise ValueError(f"routing replay: sequence {b} has routing {got}, needs {n} positions")
    return first.shape[1:]


def pack_varlen(seqs: list[RLSequence], with_routing: bool = False) -> dict[str, torch.Tensor | None]:
    """The packed layout: every sequence's input positions back to back in one row ``[1, T]``
    (T = sum of ``len(prompt) + len(completion) - 1``), ``cu_seqlens`` int32 ``[N + 1]`` their offsets
    (the model's ``cu_seqlens``), ``seq_ids`` ``[1, T]`` the sequence of each position. The other
    entries are ``pack_sequences``' on that row: ``valid`` is all true (no padding), ``advantages`` is
    per position ``[1, T]``, ``routing`` ``[1, T, n_moe, k]``."""
    _check_batch(seqs)
    with_ref = any(s.ref_logprobs is not None for s in seqs)
    ids, tgt, gen, lp_roll, lp_ref, adv, sid = [], [], [], [], [], [], []
    for b, s in enumerate(seqs):
        _check_logprobs(b, s, with_ref)
        f = s.prompt_ids + s.output_ids
        n, p = len(f) - 1, len(s.prompt_ids)
        ids.append(torch.tensor(f[:-1]))
        tgt.append(torch.tensor(f[1:]))
        g = torch.zeros(n, dtype=torch.bool)
        g[p - 1:] = s.trained()
        gen.append(g)
        z = torch.zeros(p - 1)
        lp_roll.append(torch.cat([z, torch.tensor(s.rollout_logprobs)]) if s.rollout_logprobs is not None
                       else torch.zeros(n))
        if with_ref:
            r = torch.zeros(n)
            r[g] = torch.tensor(s.ref_logprobs)
            lp_ref.append(r)
        adv.append(torch.full((n,), float(s.advantage)))
        sid.append(torch.full((n,), b, dtype=torch.long))
    routing = None
    if with_routing:
        _check_routing(seqs)
        routing = torch.cat([s.routing.long() for s in seqs]).unsqueeze(0)
    lengths = torch.tensor([_input_len(s) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    row = {"input_ids": ids, "targets": tgt, "gen_mask": gen, "rollout_logprobs": lp_roll, "advantages": adv,
           "seq_ids": sid}
    out = {k: torch.cat(v).unsqueeze(0) for k, v in row.items()}
    out.update(valid=torch.ones_like(out["gen_mask"]), routing=routing,
               ref_logprobs=torch.cat(lp_ref).unsqueeze(0) if with_ref else None, cu_seqlens=cu)
    return out


def pack_sequences(seqs: list[RLSequence], pad_id: int, with_routing: bool = False) -> dict[str, torch.Tensor]:
    """The padded layout: sequences right-padded to ``[B, L]`` (module docstring); ``valid`` marks
    real positions, ``gen_mask`` the trained ones, ``advantages`` is ``[B]``, ``routing``
    ``[B, L, n_moe, k]`` (padding positions route to experts 0..k-1; their outputs are never read).
    ``cu_seqlens`` and ``seq_ids`` are None (each row is one sequence)."""
    _check_batch(seqs)
    B = len(seqs)
    full = [s.prompt_ids + s.output_ids for s in seqs]
    L = max(len(f) for f in full) - 1
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    tgt = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    gen = torch.zeros(B, L, dtype=torch.bool)
    lp_roll = torch.zeros(B, L)
    lp_ref = torch.zeros(B, L) if any(s.ref_logprobs is not None for s in seqs) else None
    adv = torch.zeros(B)
    routing = None
    for b, (s, f) in enumerate(zip(seqs, full)):
        n = len(f) - 1
        ids[b, :n] = torch.tensor(f[:-1])
        tgt[b, :n] = torch.tensor(f[1:])
        valid[b, :n] = True
        p = len(s.prompt_ids)
        gen[b, p - 1:n] = s.trained()
        _check_logprobs(b, s, lp_ref is not None)
        if s.rollout_logprobs is not None:
            lp_roll[b, p - 1:n] = torch.tensor(s.rollout_logprobs)
        if lp_ref is not None:
            lp_ref[b][gen[b]] = torch.tensor(s.ref_logprobs)
        adv[b] = s.advantage
    if with_routing:
        k_shape = _check_routing(seqs)
        routing = torch.arange(k_shape[1]).expand(B, L, *k_shape).clone()
        for b, s in enumerate(seqs):
            routing[b, :_input_len(s)] = s.routing.long()
    return {"input_ids": ids, "targets": tgt, "valid": valid, "gen_mask": gen, "rollout_logprobs": lp_roll,
            "advantages": adv, "routing": routing, "ref_logprobs": lp_ref, "cu_seqlens": None, "seq_ids": None}


def make_batch(seqs: list[RLSequence], pad_id: int, packed: bool, with_routing: bool = False) -> dict:
    """One micro-batch in the packed (``pack_varlen``) or the padded (``pack_sequences``) layout."""
    return pack_varlen(seqs, with_routing) if packed else pack_sequences(seqs, pad_id, with_routing)


def micro_batches(lengths: list[int], budget: int, packed: bool = False) -> list[list[int]]:
    """Indices into ``lengths`` (input positions per sequence) grouped into micro-batches of at most
    ``budget`` tokens; a sequence is never split, so one longer than the budget gets a micro-batch of
    its own. Deterministic: sequences are taken longest first (ties by index).
    - ``packed``: the budget counts real tokens (the sum of the lengths, no padding in a packed row);
      first-fit decreasing: each sequence joins the first micro-batch it still fits in, so short
      sequences fill the room that long ones leave.
    - padded: the budget counts sequences x the longest input (the padded ``[B, L]``); sequences
      join the latest micro-batch while it fits, so similar lengths share one.
    ``budget`` 0: everything in one micro-batch, in order."""
    if budget <= 0:
        return [list(range(len(lengths)))] if lengths else []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    if packed:
        used: list[int] = []
        for i in order:
            j = next((j for j, u in enumerate(used) if u + lengths[i] <= budget), None)
            if j is None:
                out.append([i])
                used.append(lengths[i])
            else:
                out[j].append(i)
                used[j] += lengths[i]
        return out
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _input_len(s: RLSequence) -> int:
    return len(s.prompt_ids) + len(s.output_ids) - 1


def _generated_per_sequence(x: torch.Tensor, batch: dict, seqs: list[RLSequence]) -> list[torch.Tensor]:
    """The entries of ``x`` (``[B, L]`` or ``[1, T]``) at the trained positions (generated, loss mask
    1), one 1-D tensor per sequence of the micro-batch: in both layouts the trained positions, read
    in row-major order, are the first sequence's, then the second's, ..."""
    return list(x[batch["gen_mask"].to(x.device)].split([s.n_trained for s in seqs]))


def _forward_logp(model: K3ForCausalLM, batch: dict, temperature: float, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probabilities of the targets ``[b, L]`` (``[1, T]`` packed) and the log-softmax of
    the tempered logits ``[b, L, V]`` fp32. The logits are not kept: the log-softmax is what autograd
    saves for backward, so holding it costs nothing until backward, which frees its saved copy early;
    a caller drops it before ``backward()``, or the peak holds one ``[b, L, V]`` fp32 more.
    Token and expert ids are range-checked here on the host tensors the batch was built in, and the
    model skips its device-side checks (each would wait for the GPU queue to drain)."""
    packed = batch["cu_seqlens"] is not None
    routing = batch["routing"]
    model.check_inputs(batch["input_ids"], routing)
    out = model(to_device(batch["input_ids"], dev), None if packed else to_device(batch["valid"], dev),
                forced_routing=None if routing is None else to_device(routing, dev),
                cu_seqlens=batch["cu_seqlens"], inputs_checked=True)
    logits = out.logits.float()
    if temperature != 1.0:  # x / 1 is x: at the default, skip one elementwise pass over [b, L, V] fp32
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, -1)
    del logits
    logp = log_probs.gather(-1, to_device(batch["targets"], dev).unsqueeze(-1)).squeeze(-1)
    return logp, log_probs


@torch.no_grad()
def old_logprobs(model: K3ForCausalLM, seqs: list[RLSequence], cfg: GRPOSettings, pad_id: int,
                 temperature: float = 1.0, dp: DataParallel | None = None) -> list[torch.Tensor]:
    """``logp_old``: the trainer's log-probability of every generated token (one 1-D tensor per
    sequence) before any update of this batch, in the micro-batches and layout the updates use
    (``cfg.micro_batch_tokens``, ``cfg.packing``; with ``dp``: each rank its share, then every rank
    gets all of them)."""
    dev = next(model.parameters()).device
    model.train()
    model.use_inference_caches = False
    out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for idx in micro_batches([_input_len(s) for s in seqs], cfg.micro_batch_tokens, cfg.packing):
        mine, stand_in = _share(dp, idx)
        mseqs = [seqs[i] for i in mine]
        batch = make_batch(mseqs, pad_id, cfg.packing, with_routing=cfg.routing_replay)
        logp, _ = _forward_logp(model, batch, temperature, dev)
        # one device -> host read per micro-batch; the generated positions are picked on the host
        for i, lp in zip([] if stand_in else mine, _generated_per_sequence(logp.float().cpu(), batch, mseqs)):
            out[i] = lp.clone()
    if dp is not None:
        for part in dp.gather({i: t for i, t in enumerate(out) if t.numel()}):
            for i, t in part.items():
                out[i] = t
    return out


def _correction(seqs: list[RLSequence], old: list[torch.Tensor], cfg: GRPOSettings):
    """The batch's rollout correction (``k3core.rl.correction``) from the trainer's ``logp_old`` and
    the engine's log-probabilities of each sequence's trained tokens."""
    from k3core.rl.correction import rollout_correction

    log_rho = []
    for s, lp in zip(seqs, old):
        roll = (torch.tensor(s.rollout_logprobs, dtype=torch.float32)[s.trained()] if s.rollout_logprobs is not None
                else torch.zeros(s.n_trained))
        log_rho.append(lp.float() - roll)
    return rollout_correction(log_rho, cfg.rollout_is, cfg.tis_cap, cfg.rollout_rs, cfg.rs_low, cfg.rs_high)


_PER_UPDATE = ("loss", "clip_fraction", "approx_kl", "kl_ref", "ratio_mean", "ratio_std", "ratio_min", "ratio_max",
               "grad_norm", "tokens", "sequences", "micro_batches")


def grpo_train_step(model: K3ForCausalLM, optimizer: torch.optim.Optimizer, seqs: list[RLSequence],
                    cfg: GRPOSettings, pad_id: int, temperature: float = 1.0,
                    seq_sum_norm: float | None = None, dp: DataParallel | None = None) -> dict:
    """GRPO updates of ``model`` on one rollout batch: ``cfg.ppo_epochs`` passes, each over
    ``cfg.minibatches`` shuffled minibatches, one optimizer step per minibatch; each minibatch runs in
    micro-batches of at most ``cfg.micro_batch_tokens`` tokens (real tokens packed, sequences x
    longest input padded: ``cfg.packing``) whose gradients accumulate
    (weights of ``cfg.loss_aggregation`` fixed by the whole minibatch, so the split changes nothing
    but rounding). ``logp_old`` is the trainer's before the first update (no gradient): computed by
    one extra forward pass when there are several updates, and the detached ``logp`` itself when
    there is one (that update is on-policy: ratio 1, no clipping). TIS corrects the rollout engine's
    mismatch against ``logp_old``. ``seq_sum_norm``: the constant of ``seq-sum`` (the completion
    length cap; default the longest completion of the batch). ``cfg.kl_coef`` > 0 adds the KL penalty
    to the frozen reference, whose log-probabilities every sequence must carry (``ref_logprobs``);
    ``kl_ref`` (k3 of KL(trainer || reference) on the update's tokens, before its step) is reported
    per update whenever they are there. ``dp``: this rank's place in a data-parallel (FSDP2) group
    (module docstring); the metrics are the whole group's.

    Returns flat metrics: the batch's rollout-mismatch statistics (over every token, first pass),
    per-update statistics aggregated (``<name>`` the mean over updates, ``<name>_first`` /
    ``<name>_last``, the ratio's outer range), and ``per_update``, a list with one dict per update."""
    from k3core.rl.grpo import loss_weights, merge_stats

    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    if not seqs:
        raise ValueError("empty batch: no sequences to train on")
    n_mb = min(cfg.minibatches, len(seqs))
    n_updates = cfg.ppo_epochs * n_mb
    if cfg.kl_coef and any(s.ref_logprobs is None for s in seqs):
        raise ValueError(f"kl_coef {cfg.kl_coef}: the batch has sequences without the reference's logprobs "
                         "(run the reference_logprobs stage on it, or set kl_coef 0)")
    if cfg.loss_aggregation == "seq-sum" and seq_sum_norm is None:
        seq_sum_norm = max(s.n_trained for s in seqs)
    corrected = (cfg.rollout_is, cfg.rollout_rs) != ("token", "none")  # another correction than token TIS
    old = old_logprobs(model, seqs, cfg, pad_id, temperature, dp) if n_updates > 1 or corrected else None
    corr = _correction(seqs, old, cfg) if corrected else None
    counts_old = old is not None and (dp is None or dp.rank == 0)  # the group's tokens, counted once
    forwarded = sum(_input_len(s) for s in seqs) if counts_old else 0
    model.train()
    model.use_inference_caches = False
    first_pass: list = []  # stats of every micro-batch of the first pass: each token once, logp_old fixed
    ent_sum, ent_n = 0.0, 0
    updates: list[dict] = []
    for epoch in range(cfg.ppo_epochs):
        order = torch.randperm(len(seqs)).tolist() if n_mb > 1 else list(range(len(seqs)))
        for mb in (order[k * len(order) // n_mb:(k + 1) * len(order) // n_mb] for k in range(n_mb)):
            mseqs = [seqs[i] for i in mb]
            tokens = sum(s.n_trained for s in mseqs) if corr is None else sum(int(corr.keep[i].sum()) for i in mb)
            n_seqs = len(mseqs) if corr is None else sum(bool(corr.keep[i].any()) for i in mb)
            optimizer.zero_grad(set_to_none=True)
            parts = []
            micro = micro_batches([_input_len(s) for s in mseqs], cfg.micro_batch_tokens, cfg.packing)
            for idx in micro:
                idx, stand_in = _share(dp, idx)
                batch = make_batch([mseqs[j] for j in idx], pad_id, cfg.packing, with_routing=cfg.routing_replay)
                logp, log_probs = _forward_logp(model, batch, temperature, dev)
                mask = to_device(batch["gen_mask"], dev)
                if old is None:
                    logp_old = logp.detach()
                else:  # filled on the host: a boolean-mask assignment on a GPU sizes itself by a host read
                    host = torch.zeros(logp.shape, dtype=logp.dtype)
                    host[batch["gen_mask"]] = torch.cat([old[mb[j]] for j in idx])
                    logp_old = to_device(host, dev)
                is_w = None
                if corr is not None:  # rejected tokens leave the mask before the weights are fixed
                    keep, is_w = (torch.zeros(logp.shape, dtype=torch.bool), torch.zeros(logp.shape))
                    keep[batch["gen_mask"]] = torch.cat([corr.keep[mb[j]] for j in idx])
                    is_w[batch["gen_mask"]] = torch.cat([corr.weights[mb[j]] for j in idx])
                    mask = mask & to_device(keep, dev)
                    is_w = to_device(is_w, dev)
                w = loss_weights(mask, cfg.loss_aggregation, tokens=tokens, sequences=n_seqs, norm=seq_sum_norm,
                                 seq_ids=batch["seq_ids"])  # on the host: its largest id is read there
                ref = batch["ref_logprobs"]
                loss, st = grpo_loss(logp, logp_old, to_device(batch["rollout_logprobs"], dev),
                                     to_device(batch["advantages"], dev), mask, cfg.clip_eps_low, cfg.clip_eps_high,
                                     cfg.tis_cap, weights=w, logp_ref=None if ref is None else to_device(ref, dev),
                                     kl_coef=cfg.kl_coef, is_weights=is_w)
                if dp is not None:  # FSDP2 averages the ranks' gradients: scale back to their sum
                    loss = loss * (0.0 if stand_in else dp.world)
                if epoch == 0 and not stand_in:  # the statistic stays on the device until the step's end
                    ent_sum = ent_sum + mean_entropy(log_probs, mask).double() * st.tokens
                    ent_n += st.tokens
                del log_probs  # before backward: see _forward_logp
                loss.backward()
                del logp_old
                if stand_in:
                    del logp, loss
                    continue
                parts.append(st)
                forwarded += int(batch["valid"].sum())
                if epoch == 0:
                    first_pass.append(st)
                del logp, loss
            if dp is not None:
                parts = [st for rank_parts in dp.gather(parts) for st in rank_parts]
            grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                                       cfg.max_grad_norm)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"non-finite gradient norm {grad_norm} in update {len(updates) + 1} of "
                                         f"{n_updates}: that update was not applied")
            ramped_step(optimizer, cfg.lr_warmup_steps)
            u = asdict(merge_stats(parts))
            u.update(grad_norm=grad_norm, sequences=len(mseqs), micro_batches=len(micro))
            updates.append({k: u[k] for k in _PER_UPDATE})
    ent_sum = float(ent_sum)  # the one read of the entropy statistic
    if dp is not None:
        gathered = dp.gather((first_pass, ent_sum, ent_n, forwarded))
        first_pass = [st for g in gathered for st in g[0]]
        ent_sum, ent_n, forwarded = (sum(g[k] for g in gathered) for k in (1, 2, 3))
    dt = time.perf_counter() - t0
    batch_stats = merge_stats(first_pass)
    m = {k: getattr(batch_stats, k) for k in ("kl_rollout_trainer_k3", "kl_rollout_trainer_k1", "tis_weight_mean",
                                              "tis_truncated_fraction", "tokens")}
    if corr is not None:  # the mismatch over every token, rejected ones too; masked fractions, ratio quantiles
        m.update(corr.stats)
    for k in ("loss", "clip_fraction", "approx_kl", "kl_ref", "ratio_std", "grad_norm"):
        vals = [u[k] for u in updates]
        m.update({k: sum(vals) / len(vals), f"{k}_first": vals[0], f"{k}_last": vals[-1]})
    m.update(ratio_min=min(u["ratio_min"] for u in updates), ratio_max=max(u["ratio_max"] for u in updates),
             updates=len(updates), ppo_epochs=cfg.ppo_epochs, minibatches=n_mb,
             micro_batches=sum(u["micro_batches"] for u in updates), entropy=ent_sum / max(ent_n, 1),
             train_seconds=dt, train_tokens_per_s=forwarded / dt, per_update=updates)
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
    return {"loss": float(out.loss.detach()), "grad_norm": gn}


def table_to_sequences(table: pa.Table, n_moe: int, top_k: int) -> list[RLSequence]:
    seqs = []
    for r in table.to_pylist():
        routing = torch.tensor(r["routing"], dtype=torch.int16).view(-1, n_moe, top_k) if n_moe else None
        seqs.append(RLSequence(r["prompt_ids"], r["output_ids"], r["logprobs"], r.get("advantage", 0.0), routing,
                               loss_mask=r.get("loss_mask")))
    return seqs


def reference_logprobs_table(reference: K3ForCausalLM, table: pa.Table, cfg: GRPOSettings, pad_id: int,
                             temperature: float = 1.0) -> pa.Table:
    """The frozen ``reference``'s log-probability of every generated token of ``table`` (rollout or
    scored rows), computed as the trainer computes its own (``old_logprobs``: same temperature, same
    micro-batches, through the rollout's experts when ``cfg.routing_replay``), so that a trainer at
    the reference's weights sees no penalty (up to float rounding). One row per input row, keyed by
    (``prompt_index``, ``sample_index``): ``REF_LOGPROBS_SCHEMA``."""
    from k3core.rl.data import REF_LOGPROBS_SCHEMA

    seqs = table_to_sequences(table, len(reference.moe_layer_ids), reference.config.num_experts_per_token)
    lps = old_logprobs(reference, seqs, cfg, pad_id, temperature)
    return pa.table({"prompt_index": table.column("prompt_index"), "sample_index": table.column("sample_index"),
                     "ref_logprobs": [lp.tolist() for lp in lps]}, schema=REF_LOGPROBS_SCHEMA)


def attach_reference(seqs: list[RLSequence], table: pa.Table, ref: pa.Table) -> None:
    """Give each sequence (built from ``table``'s rows, in order) its reference log-probabilities from
    ``ref`` (``reference_logprobs_table``), matched by (prompt_index, sample_index)."""
    by_key = {(p, s): lp for p, s, lp in zip(ref.column("prompt_index").to_pylist(),
                                             ref.column("sample_index").to_pylist(),
                                             ref.column("ref_logprobs").to_pylist())}
    for seq, p, s in zip(seqs, table.column("prompt_index").to_pylist(), table.column("sample_index").to_pylist()):
        if (p, s) not in by_key:
            raise ValueError(f"no reference logprobs for prompt {p} sample {s}: the reference table was computed on "
                             "another batch (recompute it on this one)")
        seq.ref_logprobs = by_key[(p, s)]


def optimizer_steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Steps the optimizer has applied: its first parameter's ``step`` state (AdamW and StreamedAdamW
    keep one, saved with the trainer state); 0 before any. An optimizer that keeps no step count
    (SGD) reads 0 forever: run it with ``lr_warmup_steps`` 0."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            step = optimizer.state.get(p, {}).get("step")
            return 0 if step is None else int(step)
    return 0


def warmup_factor(optimizer: torch.optim.Optimizer, warmup_steps: int) -> float:
    """The learning-rate factor of the optimizer's next step: ``(taken + 1) / warmup_steps`` during
    its first ``warmup_steps`` steps, then 1 (0 steps: always 1)."""
    return min(1.0, (optimizer_steps_taken(optimizer) + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def ramped_step(optimizer: torch.optim.Optimizer, warmup_steps: int) -> None:
    """``optimizer.step()`` at its groups' learning rates times ``warmup_factor``; the groups keep
    their own rates (the factor is applied for this step only, so it never compounds)."""
    factor = warmup_factor(optimizer, warmup_steps)
    if factor == 1.0:
        optimizer.step()
        return
    rates = [g["lr"] for g in optimizer.param_groups]
    for g, lr in zip(optimizer.param_groups, rates):
        g["lr"] = lr * factor
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, rates):
            g["lr"] = lr


def train_on_table(model: K3ForCausalLM, optimizer: torch.optim.Optimizer, table: pa.Table, cfg: GRPOSettings,
                   pad_id: int, temperature: float = 1.0, seq_sum_norm: float | None = None,
                   max_groups: int | None = None, reference: pa.Table | None = None,
                   dp: DataParallel | None = None) -> dict:
    """GRPO updates on a scored batch (``grpo_train_step``). Dynamic sampling: groups (rows sharing a
    ``prompt_index``) whose rewards are all equal carry no signal and are dropped before the batch is
    split and before the loss is normalised; of the others, the first ``max_groups`` by prompt index
    are trained on (a batch refilled by extra rollout rounds keeps its size). Reported:
    ``groups_sampled``, ``groups_dropped`` (uniform), ``groups_unused`` (beyond ``max_groups``),
    ``groups_trained``, ``sequences``. A batch where every group is uniform is a no-op step
    (``skipped`` 1). ``reference``: the frozen reference's log-probabilities of the batch
    (``reference_logprobs_table``), needed when ``cfg.kl_coef`` > 0. ``dp``: see ``grpo_train_step``."""
    n_moe, k = len(model.moe_layer_ids), model.config.num_experts_per_token
    seqs = table_to_sequences(table, n_moe, k)
    if reference is not None:
        attach_reference(seqs, table, reference)
    index = table.column("prompt_index").to_pylist()
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    rewards = table.column("reward").to_pylist()
    informative = sorted(g for g, rows in groups.items() if len({rewards[i] for i in rows}) > 1)
    trained = set(informative[:max_groups] if max_groups is not None else informative)
    kept = [s for s, g in zip(seqs, index) if g in trained]
    counts = {"groups_sampled": len(groups), "groups_dropped": len(groups) - len(informative),
              "groups_unused": len(informative) - len(trained), "groups_trained": len(trained),
              "sequences": len(kept)}
    if not kept:
        return {"skipped": 1.0, **counts}
    m = grpo_train_step(model, optimizer, kept, cfg, pad_id, temperature, seq_sum_norm=seq_sum_norm, dp=dp)
    m.update(counts, skipped=0.0)
    return m
