"""Supervised warm-up: teach the answer format from an environment's reference completions."""

from __future__ import annotations

import time

import torch

from k3core.model import K3ForCausalLM
from k3core.rl.train import RLSequence, sft_step
from k3core.rl.trainer_state import make_optimizer
from k3core.tokenizer import ByteTokenizer


def supervised_warmup(model: K3ForCausalLM, env, env_spec: str, tok: ByteTokenizer, steps: int, batch_size: int,
                      lr: float, seed: int, log=None, progress=None) -> dict:
    """Teach the answer format from ``env.reference`` on training prompts (never held-out ones).
    ``log(text)``: every tenth step's loss; ``progress(done, steps)``: after every step (a display)."""
    from k3core.rl.data import training_prompts

    if not hasattr(env, "reference"):
        raise ValueError(f"environment {env_spec!r} has no reference(prompt) method: run with --warmup-steps 0")
    torch.manual_seed(seed)
    opt = make_optimizer(model, lr)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        prompts = training_prompts(env, seed + 7919, step, batch_size, env_spec)
        seqs = [RLSequence(tok.encode(p), tok.encode(env.reference(p), bos=False) + [tok.eos_id]) for p in prompts]
        losses.append(sft_step(model, opt, seqs, tok.pad_id)["loss"])
        if log and (step % 10 == 0 or step == steps - 1):
            log(f"warm-up step {step + 1}/{steps}: loss {losses[-1]:.3f}")
        if progress:
            progress(step + 1, steps)
    return {"warmup_steps": steps, "warmup_loss_first": losses[0] if losses else None,
            "warmup_loss_last": losses[-1] if losses else None, "warmup_seconds": time.perf_counter() - t0}
