"""RL in one process, without Prefect or artifacts: the functions the pipeline's stages call
(``training_prompts``, ``rollout_table``, ``score_table``, ``train_on_table`` with ``StreamedAdamW``),
with a float engine that takes the trainer's weights in memory after every update. With
``kl_coef`` > 0 the frozen reference is the starting model, and its log-probabilities of each batch
come from ``reference_logprobs_table`` (the pipeline's reference stage). For notebooks,
the learning test and the update-rule benchmark; the pipeline itself is ``flows/pipeline.py``."""

from __future__ import annotations

import copy
import time

import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.data import heldout_prompts, training_prompts
from k3core.rl.tables import rollout_table, score_table
from k3core.rl.train import reference_logprobs_table, train_on_table
from k3core.rl.trainer_state import make_optimizer
from k3core.rl.weights import engine_from_model, engine_state
from k3core.rollout.engine import SamplingParams
from k3core.settings import GRPOSettings
from k3core.rl.prompting import PromptFormat
from k3core.tokenizer import ByteTokenizer


def rl_in_process(env, spec: str, config: K3Config, seed: int, iterations: int, settings: GRPOSettings,
                  prompts: int, group: int, max_new_tokens: int, eval_every: int = 0, heldout: int = 16) -> dict:
    """``iterations`` RL iterations from a fresh model of ``config`` (seeded as ``init:PRESET:SEED``).

    Held-out reward (``heldout`` prompts x 4 samples, fixed seed) is measured before the first update,
    every ``eval_every`` iterations (0: never in between) and after the last. Returns ``heldout``
    ({iteration: reward}), ``train_reward``, ``metrics`` (the train step's, per iteration),
    ``seconds`` (per iteration, rollout to weight load), ``model`` (the trained policy) and
    ``reference`` (the frozen starting model, when ``settings.kl_coef`` > 0)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(config)
    model.reset_parameters(seed)
    tok = PromptFormat(ByteTokenizer(config), chat=False)
    engine = engine_from_model(copy.deepcopy(model).eval(), 0, quantized=False)
    optimizer = make_optimizer(model, settings.lr)
    reference = copy.deepcopy(model).requires_grad_(False) if settings.kl_coef else None

    def sampling(n: int, sample_seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, n=n, seed=sample_seed,
                              stop_token_ids=tok.stop_ids)

    held = heldout_prompts(env, seed, heldout, spec)

    def heldout_reward(version: int) -> float:
        return score_table(rollout_table(engine, tok, held, sampling(4, 999), version), env, spec, 4)[1]["reward_mean"]

    out: dict = {"heldout": {0: heldout_reward(0)}, "train_reward": [], "metrics": [], "seconds": []}
    for it in range(iterations):
        t0 = time.perf_counter()
        batch = rollout_table(engine, tok, training_prompts(env, seed, it, prompts, spec),
                              sampling(group, seed * 100003 + it), it)
        scored, stats = score_table(batch, env, spec, group, scale_advantages=settings.scale_advantages)
        ref = None if reference is None else reference_logprobs_table(reference, scored, settings, tok.pad_id, 1.0)
        out["metrics"].append(train_on_table(model, optimizer, scored, settings, tok.pad_id, 1.0,
                                             seq_sum_norm=max_new_tokens, reference=ref))
        engine.load_weights(engine_state(model, quantize_experts=False), it + 1)
        out["seconds"].append(time.perf_counter() - t0)
        out["train_reward"].append(stats["reward_mean"])
        if (eval_every and (it + 1) % eval_every == 0) or it + 1 == iterations:
            out["heldout"][it + 1] = heldout_reward(it + 1)
    out.update(model=model, reference=reference)
    return out
