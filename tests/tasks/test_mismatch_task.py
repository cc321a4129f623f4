"""The per-iteration mismatch stage on the tiny preset: rollouts from the W4A8 engine, then KL(trainer ||
W4A8 engine) beside KL(trainer || float engine) on a seeded subsample, without touching the process RNG."""

import random

import torch
from prefect.logging import disable_run_logger

from k3core.artifacts import Artifact
from k3core.rl.trainer_state import make_optimizer, save_trainer_state
from k3core.rl.weights import load_policy
from k3core.settings import RolloutSettings
from k3core.rl import engines, trainers
from tasks.common import Run
from tasks.fetch import fetch_checkpoint
from tasks.mismatch import rollout_mismatch
from tasks.quantize import quantize_mxfp4
from tasks.rollout import engine_for, rollout


def test_mismatch_stage_reports_both_kls_and_their_ratio(tmp_path):
    run = Run(str(tmp_path), "m", env="add", seed=0)
    engines.clear()
    trainers.clear()
    with disable_run_logger():
        ck = fetch_checkpoint.fn(run, "init:tiny:5")
        w = quantize_mxfp4.fn(run, ck)
        ro = rollout.fn(run, 0, w, RolloutSettings(prompts_per_iteration=3, samples_per_prompt=4, max_new_tokens=5))
    from k3core.rollout.quantized import expert_format

    assert expert_format(engine_for(run, w).model) == "w4a8"  # quantised weights: the W4A8 engine
    engines.clear()
    # A DCP trainer state, saved under other RNG states: loading it restores those, and the stage must
    # put the process's own back (its later stages sample with them).
    model = load_policy(ck.path)
    torch.manual_seed(999)
    random.seed(999)
    opt = make_optimizer(model, 1e-3)
    saved = torch.get_rng_state(), random.getstate()  # what the state records
    save_trainer_state(tmp_path / "state", model, opt, {"iteration": 0})
    torch.manual_seed(123)
    random.seed(123)
    before = torch.get_rng_state()
    state = Artifact("dcp", "file:///state", str(tmp_path / "state"), "x", version=0)
    m = rollout_mismatch.fn(run, 0, state, ro, 5, 1.0)
    # torch's generator exactly (nothing else in the process draws from it); Python's only against the
    # checkpoint's state, since background threads of the process (websocket keep-alive pings of
    # Prefect's event client) draw from the global `random` at any time.
    assert torch.equal(torch.get_rng_state(), before) and not torch.equal(before, saved[0])
    assert random.getstate() != saved[1]
    assert m["mismatch_sequences"] == 5
    assert 0 < m["mismatch_bf16_kl"] < m["mismatch_w4a8_kl"]
    assert m["mismatch_kl_ratio"] == m["mismatch_w4a8_kl"] / m["mismatch_bf16_kl"]
    # the same weights as a public checkpoint: the same figures
    assert m == {**rollout_mismatch.fn(run, 0, ck, ro, 5, 1.0), "mismatch_seconds": m["mismatch_seconds"]}
