"""The policy learns: RL from a fresh tiny model, no warm-up, on an environment defined here.

The loop is the pipeline's without Prefect and without files: prompts from the data cursor
(``training_prompts``), rollouts on the embedded engine (``rollout_table``), rewards and group
advantages (``score_table``), the GRPO update (``train_on_table``: 2 PPO epochs x 2 minibatches in
micro-batches of at most 128 tokens, packed by default, ``StreamedAdamW``), then the new weights into the engine
(``engine_state`` + ``load_weights``, the in-process transfer). Held-out prompts (never trained on)
are sampled with one fixed seed before the first and after the last iteration.

Environment: the completion's share of lowercase ASCII letters (dense, exact, in [0, 1]); a random
byte-level policy scores about 26/260. The assertion asks for +0.2 held-out reward, about half the
smallest gain over three seeds (``python tests/k3core/rl/test_learning.py`` prints them; the figures
are in docs/benchmarks.md); the held-out mean is over 64 samples, whose standard error is a few
hundredths.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.usefixtures("single_thread")

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
    from k3core.rl.loop import rl_in_process
    from k3core.settings import GRPOSettings

    settings = GRPOSettings(lr=3e-3, ppo_epochs=2, minibatches=2, micro_batch_tokens=128)
    t0 = time.perf_counter()
    r = rl_in_process(LowercaseShare(), "test:lowercase-share", K3Config.preset("tiny"), seed, iterations, settings,
                      PROMPTS, GROUP, MAX_NEW)
    return dict(start=r["heldout"][0], end=r["heldout"][iterations], train_reward=r["train_reward"],
                metrics=r["metrics"], seconds=time.perf_counter() - t0)


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
