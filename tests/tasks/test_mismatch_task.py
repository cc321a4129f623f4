"""The per-iteration mismatch stage on the tiny preset: rollouts from the W4A8 engine, then KL(trainer ||
W4A8 engine) beside KL(trainer || float engine) on a seeded subsample, without touching the process RNG."""

import random

import torch
from prefect.logging import disable_run_logger

from tasks import engines
from tasks.fetch import fetch_checkpoint
from tasks.mismatch import rollout_mismatch
from tasks.quantize import quantize_mxfp4
from tasks.rollout import engine_for, rollout


def test_mismatch_stage_reports_both_kls_and_their_ratio(tmp_path):
    root = str(tmp_path)
    engines.clear()
    with disable_run_logger():
        ck = fetch_checkpoint("init:tiny:5", root, "runs/m/source")
        w = quantize_mxfp4(ck | {"kind": "hf", "version": 0}, root, "runs/m/rollout-weights-v0")
        ro = rollout("m", 0, w, "add", 3, 4, 5, 1.0, 1.0, 0, root, "runs/m/iter-0000/rollouts.parquet")
    from k3core.rollout.quantized import expert_format

    assert expert_format(engine_for("m", w).model) == "w4a8"  # quantised weights: the W4A8 engine
    engines.clear()
    torch.manual_seed(123)
    random.seed(123)
    before = torch.get_rng_state(), random.getstate()
    m = rollout_mismatch(ck | {"kind": "hf"}, ro, 5, 1.0, 0)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert m["mismatch_sequences"] == 5
    assert 0 < m["mismatch_bf16_kl"] < m["mismatch_w4a8_kl"]
    assert m["mismatch_kl_ratio"] == m["mismatch_w4a8_kl"] / m["mismatch_bf16_kl"]
    assert m == {**rollout_mismatch(ck | {"kind": "hf"}, ro, 5, 1.0, 0), "mismatch_seconds": m["mismatch_seconds"]}
