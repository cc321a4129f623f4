"""Per-iteration train/inference mismatch: on a seeded subsample of the iteration's rollouts, KL(trainer ||
W4A8 engine) beside KL(trainer || float engine) and their ratio (``k3core.rl.mismatch``), from the trainer
weights the rollouts were sampled with. Cheap by construction: a few sequences, three small forwards."""

from __future__ import annotations

import math
import random
import time


def rollout_mismatch(state: dict, rollouts: dict, n_sequences: int, temperature: float, seed: int,
                     dtype: str = "bfloat16") -> dict:
    """``state``: the trainer weights at the rollouts' version (a public checkpoint or a DCP trainer
    state); ``rollouts``: the rollout stage's output. Returns ``mismatch_*`` metrics."""
    import pyarrow.parquet as pq
    import torch

    from k3core.rl.mismatch import measure_mismatch
    from k3core.rl.stages import load_policy, load_trainer_state
    from k3core.tokenizer import ByteTokenizer

    t0 = time.perf_counter()
    table = pq.read_table(rollouts["path"], columns=["prompt_ids", "output_ids"])
    g = torch.Generator().manual_seed(seed * 7919 + table.num_rows)
    pick = torch.randperm(table.num_rows, generator=g)[:n_sequences].sort().values.tolist()
    rows = table.take(pick).to_pylist()
    seqs = [(r["prompt_ids"], r["output_ids"]) for r in rows if r["output_ids"]]
    rng = torch.get_rng_state(), random.getstate()
    try:  # loading a trainer state restores its RNG states: keep the process's own
        model = load_trainer_state(state["path"], lr=0.0)[0] if state["kind"] == "dcp" else load_policy(state["path"])
    finally:
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
    out = measure_mismatch(model, seqs, ByteTokenizer(model.config).pad_id, temperature, getattr(torch, dtype))
    keep = ("w4a8_kl", "bf16_kl", "kl_ratio", "w4a8_k3", "bf16_k3", "w4a8_kl_max", "bf16_kl_max")
    metrics = {f"mismatch_{k}": out[k] for k in keep}
    if not math.isfinite(metrics["mismatch_kl_ratio"]):  # the float engine matched exactly: no ratio
        metrics["mismatch_kl_ratio"] = None
    metrics["mismatch_sequences"] = len(seqs)
    metrics["mismatch_seconds"] = time.perf_counter() - t0
    return metrics
