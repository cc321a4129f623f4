"""rollout_mismatch: the per-iteration train/inference mismatch. On a seeded subsample of the
iteration's rollouts, KL(trainer || W4A8 engine) beside KL(trainer || float engine) and their ratio
(``k3core.rl.mismatch``), from the trainer weights the rollouts were sampled with. Cheap by
construction: a few sequences, three small forwards."""

from __future__ import annotations

import math
import time

from k3core.artifacts import Artifact
from k3core.rl import trainers
from tasks.common import Run, read_table, stage


@stage(run_name="rollout_mismatch-iter{iteration}", key="mismatch",
       inputs=lambda rollouts, state, **_: [rollouts.uri, state.uri])
def rollout_mismatch(run: Run, iteration: int, state: Artifact, rollouts: Artifact, n_sequences: int,
                     temperature: float) -> dict:
    """``state``: the trainer weights at the rollouts' version (a public checkpoint or a DCP trainer
    state), on the run's device (the trainer's copies and both engines live there). Returns
    ``mismatch_*`` metrics. The engines score the rollouts through the decode path the run's engine
    runs (``Run.decode``)."""
    import torch

    from k3core.rl.mismatch import measure_mismatch
    from k3core.rl.trainer_state import rng_state, set_rng_state

    t0 = time.perf_counter()
    table = read_table(rollouts, columns=["prompt_ids", "output_ids", "loss_mask"])
    g = torch.Generator().manual_seed(run.seed * 7919 + table.num_rows)
    pick = torch.randperm(table.num_rows, generator=g)[:n_sequences].sort().values.tolist()
    rows = table.take(pick).to_pylist()
    rows = [r for r in rows if r["output_ids"]]
    seqs = [(r["prompt_ids"], r["output_ids"]) for r in rows]
    rng = rng_state()
    try:  # the metric must not move the process's RNG (the train step's draws depend on it)
        model = trainers.weights(run.run_id, state, run.device, run.dtype)
        out = measure_mismatch(model, seqs, model.config.pad_token_id, temperature, torch.bfloat16,
                               decode=run.decode, masks=[r["loss_mask"] for r in rows])
    finally:
        set_rng_state(rng)
    keep = ("w4a8_kl", "bf16_kl", "kl_ratio", "w4a8_k3", "bf16_k3", "w4a8_kl_max", "bf16_kl_max")
    metrics = {f"mismatch_{k}": out[k] for k in keep}
    if not math.isfinite(metrics["mismatch_kl_ratio"]):  # the float engine matched exactly: no ratio
        metrics["mismatch_kl_ratio"] = None
    metrics["mismatch_sequences"] = len(seqs)
    metrics["mismatch_seconds"] = time.perf_counter() - t0
    return metrics
