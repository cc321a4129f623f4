"""Every CPU decode mode against the no-cache forward in bf16: greedy agreement on a warmed-up
checkpoint, and the same check failing on a planted decode-state bug (``k3core.rollout.agreement``).
The GPU modes (graph included) take the same checkpoint and criterion:
tests/k3core/rollout/test_cuda_graph_decode.py."""

import copy

import pytest
import torch

import k3core.model.kda as kda_module
from k3core.rollout.agreement import greedy_agreement, greedy_outputs
from k3core.rollout.quantized import quantize_engine_model
from tests.k3core.rollout.warmed import SMALL, reverse_prompts, warmed

# each test warms up (once per process) and decodes the `small` preset twice: past the unmarked-test limit;
# one intra-op thread: beside another xdist worker on 2 cores, two threads per process mostly wait at
# barriers (docs/results/test_suite.md)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

NEAR_TIE = 0.25  # a bf16 logit of order 5 rounds by ~0.03; a parting above this margin is not rounding


def _bf16(experts: str, seed: int = 0):
    m = warmed(seed, torch.bfloat16)
    if experts == "w4a8":
        quantize_engine_model(m, act_granularity="token")
        m.refresh_inference_caches()
    return m


@pytest.mark.parametrize("experts", ["bf16", "w4a8"])
def test_every_cpu_decode_mode_agrees_with_the_no_cache_forward_bf16(experts):
    """dynamic and static decode (16 prompts through max_batch 4: joins and leaves) against the same
    bf16 model's no-cache forward: at least 99% of greedy positions agree and every parting is a
    near-tie. W4A8: the engine's packed MXFP4 experts with FP8 activations, forward and decode alike."""
    model = _bf16(experts)
    prompts = reverse_prompts()
    for mode in ("dynamic", "static"):
        got = greedy_agreement(model, prompts, greedy_outputs(copy.deepcopy(model), prompts, mode))
        print(f"{experts} {mode}: {got.describe()}")
        assert got.total >= 16 * 8, got.describe()
        assert got.fraction >= 0.99, f"{experts} {mode}: {got.describe()}"
        assert all(p.margin < NEAR_TIE for p in got.partings), f"{experts} {mode}: {got.describe()}"


def test_the_check_fails_on_a_one_percent_kda_state_error(monkeypatch):
    """A decode-state bug the logits barely show: every decode step's incoming KDA state scaled by
    0.99: agreement must fall below the 99% criterion (the measured drop: docs/results/rollout_decode.md)."""
    model = _bf16("bf16")
    prompts = reverse_prompts()
    step = kda_module.kda_step

    def decayed(q, k, v, g, beta, state, *args, **kwargs):
        return step(q, k, v, g, beta, None if state is None else state * 0.99, *args, **kwargs)

    monkeypatch.setattr(kda_module, "kda_step", decayed)
    outputs = greedy_outputs(copy.deepcopy(model), prompts, "dynamic")
    monkeypatch.setattr(kda_module, "kda_step", step)  # the forward reference runs the chunked path anyway
    got = greedy_agreement(model, prompts, outputs)
    print(got.describe())
    assert got.fraction < 0.99, got.describe()


def test_random_init_weights_cannot_hold_the_criterion():
    """Why the check takes a warmed-up checkpoint: on random-init weights the top-2 logits are a
    near-tie at most positions and a correct bf16 decode already misses 99%
    (docs/results/rollout_decode.md has the measured agreement)."""
    from k3core.model import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(SMALL)
    model.reset_parameters(0)
    model = model.cast(torch.bfloat16).eval()
    prompts = reverse_prompts()
    got = greedy_agreement(model, prompts, greedy_outputs(copy.deepcopy(model), prompts, "dynamic"))
    print(got.describe())
    assert got.median_margin() < 0.5 and got.fraction < 0.99, got.describe()
