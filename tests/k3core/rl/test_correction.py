"""``k3core.rl.correction`` against a naive reference written from each definition with Python floats
(per token, per sequence, no tensors), on random batches, and its quantiles against numpy's."""

import math
import random

import numpy as np
import pytest
import torch

from k3core.rl.correction import rollout_correction
from k3core.settings import IS_LEVELS, RS_LEVELS


def _naive(log_rho, is_level, cap, rs_level, low, high):
    weights, keep = [], []
    for seq in log_rho:
        rho = [math.exp(x) for x in seq]
        prod = math.exp(sum(seq))
        geo = math.exp(sum(seq) / len(seq))
        w = {"token": rho, "sequence": [prod] * len(seq), "none": [1.0] * len(seq)}[is_level]
        w = [min(x, cap) for x in w]
        k = {"none": [True] * len(seq), "token": [low <= r <= high for r in rho],
             "sequence": [low <= prod <= high] * len(seq), "geometric": [low <= geo <= high] * len(seq)}[rs_level]
        weights.append(w)
        keep.append(k)
    return weights, keep


def _batch(seed):
    rnd = random.Random(seed)
    return [[rnd.gauss(0.0, 0.3) for _ in range(rnd.randint(1, 9))] for _ in range(12)]


@pytest.mark.parametrize("rs_level", RS_LEVELS)
@pytest.mark.parametrize("is_level", IS_LEVELS)
def test_weights_and_masks_equal_the_definitions(is_level, rs_level):
    for seed, (low, high, cap) in enumerate([(0.5, 2.0, 2.0), (0.0, 1.5, 1.5), (0.99, 1.01, 5.0), (0.8, 1.1, 1.05)]):
        log_rho = _batch(seed)
        got = rollout_correction([torch.tensor(s) for s in log_rho], is_level, cap, rs_level, low, high)
        want_w, want_k = _naive(log_rho, is_level, cap, rs_level, low, high)
        for g, w in zip(got.weights, want_w):
            assert g.tolist() == pytest.approx(w, rel=1e-6)
        assert [k.tolist() for k in got.keep] == want_k
        n = sum(len(k) for k in want_k)
        assert got.stats["rs_masked_fraction"] == pytest.approx(1 - sum(map(sum, want_k)) / n)
        assert got.stats["rs_seq_masked_fraction"] == pytest.approx(sum(not all(k) for k in want_k) / len(want_k))


def test_statistics_against_numpy_and_the_mismatch_estimators():
    log_rho = _batch(7)
    flat = np.array([x for s in log_rho for x in s])
    got = rollout_correction([torch.tensor(s) for s in log_rho], "token", 1.2, "none").stats
    for q, name in ((1, "p01"), (50, "p50"), (99, "p99")):
        assert got[f"ratio_rollout_{name}"] == pytest.approx(np.percentile(np.exp(flat), q), rel=1e-6)
    seq = np.exp([sum(s) for s in log_rho])
    assert got["seq_ratio_p50"] == pytest.approx(np.percentile(seq, 50), rel=1e-6)
    assert got["kl_rollout_trainer_k3"] == pytest.approx(np.mean(np.exp(flat) - 1 - flat), rel=1e-6)
    assert got["kl_rollout_trainer_k1"] == pytest.approx(np.mean(-flat), rel=1e-6)
    assert got["tis_truncated_fraction"] == pytest.approx(np.mean(np.exp(flat) > 1.2))


def test_a_long_sequence_does_not_overflow_and_a_bad_setting_is_named():
    long = torch.full((5000,), 0.05)  # a product of e^250
    c = rollout_correction([long], "sequence", 2.0, "sequence", 0.0, 2.0)
    assert torch.isfinite(c.weights[0]).all() and c.weights[0][0] == 2.0 and not c.keep[0].any()
    with pytest.raises(ValueError, match="rollout_rs 'tokens'"):
        rollout_correction([long], "token", 2.0, "tokens")
    with pytest.raises(ValueError, match=r"band \[2.0, 1.0\]"):
        rollout_correction([long], "token", 2.0, "token", 2.0, 1.0)
