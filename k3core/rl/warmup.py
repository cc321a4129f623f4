"""Supervised warm-up: teach the answer format from an environment's reference completions, after
an optional copy phase that teaches a fresh model to repeat what it reads.

A model trained from scratch (the CPU presets) does not copy: an agentic episode must copy the
prompt's operands into its tool call and the tool's result into its answer, and a fresh `small`
model learns that only after a long plateau of the reference warm-up (then its loss falls at once),
which on full reference episodes costs hundreds of steps of a few hundred tokens each. The
copy phase teaches the same skill on sequences of a few dozen tokens: the user turn is a text drawn
from the environment's own training prompts and the answer is that text again, in a bare
conversation (no system turn, no tools). The text is ``env.copied(prompt)`` where the environment
says what its episodes copy (``tools-calc``: the operands its calls repeat), else the prompt. That
matters: on ``small``, copies of the operands were learned in about 120 steps and copies of whole
``tools-calc`` prompts not in 150 (docs/results/tools_calc.md). A checkpoint that already copies
(any pretrained one) needs no copy phase.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from k3core.model import K3ForCausalLM
from k3core.rl.train import RLSequence, sft_step
from k3core.rl.trainer_state import make_optimizer
from k3core.rl.prompting import PromptFormat
from k3core.settings import COPY_BATCH_FACTOR

COPY_STREAM = 104729  # the copy phase's prompts are a stream of their own (the reference phase's stays as it was)


def supervised_warmup(model: K3ForCausalLM, env, env_spec: str, fmt: PromptFormat, steps: int, batch_size: int,
                      lr: float, seed: int, log=None, progress=None, copy_steps: int = 0) -> dict:
    """``copy_steps`` steps of the copy phase (module docstring; ``COPY_BATCH_FACTOR * batch_size``
    sequences each), then ``steps`` steps teaching ``env.reference`` (or, agentic,
    ``reference_turns``), both on training prompts (never held-out ones), with one optimizer.
    ``log(text)``: every tenth step's loss; ``progress(done, total)``: after every step (a display).
    ``fmt``: the prompts as the rollouts write them, the answer ending as a sampled one would
    (``k3core.rl.prompting``)."""
    from k3core.rl.data import training_prompts

    if steps and not (hasattr(env, "reference") or hasattr(env, "reference_turns")):
        raise ValueError(f"environment {env_spec!r} has no reference(prompt) (or, agentic, reference_turns(prompt)) "
                         "method: run with --warmup-steps 0")
    torch.manual_seed(seed)
    opt = make_optimizer(model, lr)
    total, t0 = copy_steps + steps, time.perf_counter()
    copied, losses = [], []
    for step in range(total):
        copying = step < copy_steps
        done, of, phase = (step, copy_steps, copied) if copying else (step - copy_steps, steps, losses)
        if copying:
            prompts = training_prompts(env, seed + COPY_STREAM, done, COPY_BATCH_FACTOR * batch_size, env_spec)
            seqs = [copy_sequence(fmt, copy_text(env, p)) for p in prompts]
        else:
            seqs = [_taught(fmt, env, p) for p in training_prompts(env, seed + 7919, done, batch_size, env_spec)]
        phase.append(sft_step(model, opt, seqs, fmt.pad_id)["loss"])
        if log and (done % 10 == 0 or done == of - 1):
            log(f"warm-up {'copy ' if copying else ''}step {done + 1}/{of}: loss {phase[-1]:.3f}")
        if progress:
            progress(step + 1, total)
    out = {"warmup_steps": steps, "warmup_loss_first": losses[0] if losses else None,
           "warmup_loss_last": losses[-1] if losses else None, "warmup_seconds": time.perf_counter() - t0}
    if copy_steps:
        out.update(warmup_copy_steps=copy_steps, warmup_copy_loss_last=copied[-1])
    return out


def copy_text(env, prompt: str) -> str:
    """What the copy phase repeats for ``prompt``: ``env.copied(prompt)`` where the environment says
    what its episodes copy, else the prompt."""
    copied = getattr(env, "copied", None)
    return copied(prompt) if callable(copied) else prompt


def copy_sequence(fmt: PromptFormat, prompt: str) -> RLSequence:
    """``prompt`` as the user turn and again as the answer, in a bare conversation (a chat without the
    environment's system turn and tools; a raw prompt as it is): what the copy phase teaches."""
    bare = replace(fmt, env=None)
    return RLSequence(bare.prompt_ids(prompt), bare.answer_ids(prompt))


def _taught(fmt: PromptFormat, env, prompt: str) -> RLSequence:
    """One warm-up sequence: the reference answer after the prompt, or, for an agentic environment,
    its reference episode (``k3core.rl.episodes.reference_trajectory``: only the assistant turns are
    taught, the tool results are context)."""
    from k3core.rl.episodes import is_agentic, reference_trajectory

    if is_agentic(env) and hasattr(env, "reference_turns"):
        ep = reference_trajectory(fmt, env, prompt)
        return RLSequence(ep.prompt_ids, ep.output_ids, loss_mask=ep.loss_mask)
    return RLSequence(fmt.prompt_ids(prompt), fmt.answer_ids(env.reference(prompt)))


def warmed_up_model(config, steps: int = 25, seed: int = 0, env_spec: str = "reverse", batch_size: int = 32,
                    lr: float = 1e-3, before=None) -> K3ForCausalLM:
    """A model of ``config`` (initialised from ``seed``) after ``steps`` supervised warm-up steps on
    ``env_spec``, fp32, on the CPU: a checkpoint whose greedy choices have clear margins. On the
    `small` preset, 25 steps (about 30 s on 2 cores) move the median top-2 logit margin on held-out
    `reverse` prompts from 0.07 to 2.0, which is what a bf16 decode-agreement check needs
    (``k3core.rollout.agreement``). ``before(model)``: applied before the warm-up, e.g. a fixed
    router bias, so that the warm-up trains the model the check will run."""
    from k3core.rl.envs import load_env

    torch.manual_seed(seed)
    model = K3ForCausalLM(config)
    model.reset_parameters(seed)
    if before is not None:
        before(model)
    if steps:
        from k3core.tokenizer import ByteTokenizer

        supervised_warmup(model, load_env(env_spec), env_spec, PromptFormat(ByteTokenizer(config), chat=False), steps,
                          batch_size, lr, seed)
    return model.eval()
