"""The policy learns: RL from a fresh tiny model, no warm-up, on an environment defined here.

The loop is the pipeline's without Prefect and without files: prompts from the data cursor
(``training_prompts``), rollouts on the embedded engine (``rollout_table``), rewards and group
advantages (``score_table``), the GRPO update (``train_on_table``: 2 PPO epochs x 2 minibatches in
micro-batches of at most 128 padded tokens, ``StreamedAdamW``), then the new weights into the engine
(``engine_state`` + ``load_weights``, the in-process transfer). Held-out prompts (never trained on)
are sampled with one fixed seed before the first and after the last iteration.

Environment: the completion's share of lowercase ASCII letters (dense, exact, in [0, 1]); a random
byte-level policy scores about 26/260. The assertion asks for +0.2 held-out reward, about half the
smallest gain over three seeds (``python tests/k3core/rl/test_learning.py`` prints them; the figures
are in docs/benchmarks.md); the held-out mean is over 64 samples, whose standard error is a few
hundredths.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

ITERATIONS, PROMPTS, GROUP, MAX_NEW = 10, 8, 8, 6


class LowercaseShare:
    """``"say:abc="`` -> anything; reward: the share of the completion's characters that are a-z."""

    name = "lowercase-share"

    def prompts(self, rng, n):
        return ["say:" + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4))) + "=" for _ in range(n)]

    def reward(self, prompt, completion):
        return sum("a" <= c <= "z" for c in completion) / len(completion) if completion else 0.0


def learn(seed: int, iterations: int = ITERATIONS) -> dict:
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.data import heldout_prompts, training_prompts
    from k3core.rl.tables import rollout_table, score_table
    from k3core.rl.train import train_on_table
    from k3core.rl.trainer_state import make_optimizer
    from k3core.rl.weights import engine_from_model, engine_state
    from k3core.rollout.engine import SamplingParams
    from k3core.settings import GRPOSettings
    from k3core.tokenizer import ByteTokenizer

    env, spec = LowercaseShare(), "test:lowercase-share"
    cfg = K3Config.preset("tiny")
    torch.manual_seed(seed)
    model = K3ForCausalLM(cfg)
    model.reset_parameters(seed)  # what init:tiny:SEED holds (in fp32 here)
    tok = ByteTokenizer(cfg)
    engine = engine_from_model(copy.deepcopy(model).eval(), 0, quantized=False)
    settings = GRPOSettings(lr=3e-3, ppo_epochs=2, minibatches=2, micro_batch_tokens=128)
    optimizer = make_optimizer(model, settings.lr)

    def sampling(n, seed_):
        return SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=n, seed=seed_, stop_token_ids=(tok.eos_id,))

    heldout = heldout_prompts(env, seed, 16, spec)

    def heldout_reward(version):
        table = rollout_table(engine, tok, heldout, sampling(4, 999), version)
        return score_table(table, env, spec, 4)[1]["reward_mean"]

    t0 = time.perf_counter()
    start = heldout_reward(0)
    train_reward, metrics = [], []
    for it in range(iterations):
        prompts = training_prompts(env, seed, it, PROMPTS, spec)
        rollouts = rollout_table(engine, tok, prompts, sampling(GROUP, seed * 100003 + it), it)
        scored, stats = score_table(rollouts, env, spec, GROUP, scale_advantages=settings.scale_advantages)
        metrics.append(train_on_table(model, optimizer, scored, settings, tok.pad_id, 1.0, seq_sum_norm=MAX_NEW))
        engine.load_weights(engine_state(model, quantize_experts=False), it + 1)
        train_reward.append(stats["reward_mean"])
    end = heldout_reward(iterations)
    return dict(start=start, end=end, train_reward=train_reward, metrics=metrics, seconds=time.perf_counter() - t0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add barrier waits on a shared 2-core CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_rl_raises_heldout_reward_from_a_fresh_tiny_model():
    r = learn(seed=0)
    assert r["end"] > r["start"] + 0.2, r
    assert sum(r["train_reward"][-3:]) / 3 > sum(r["train_reward"][:3]) / 3 + 0.1, r["train_reward"]
    updates = [m for m in r["metrics"] if not m["skipped"]]
    assert updates and all(m["updates"] == 4 for m in updates)
    # minibatch updates leave the on-policy point: the clip engages somewhere in the run
    assert max(m["clip_fraction"] for m in updates) > 0
    assert max(m["approx_kl_last"] for m in updates) > 0


if __name__ == "__main__":  # the numbers in the docstring: three seeds
    torch.set_num_threads(1)
    for s in (0, 1, 2):
        r = learn(s)
        print(f"seed {s}: held-out {r['start']:.3f} -> {r['end']:.3f}; train reward "
              f"{[round(x, 3) for x in r['train_reward']]}; clip fraction max "
              f"{max(m.get('clip_fraction', 0) for m in r['metrics']):.3f}; {r['seconds']:.1f} s", flush=True)
