"""One tiny iteration on CUDA against the same iteration on the CPU (marked ``gpu``; skipped without
CUDA). Run on the GPU machine: ``pytest -m gpu tests/tasks/test_device_gpu.py``.

- Greedy rollouts (temperature 0) of the W4A8 engine give the same tokens, except where the CPU's
  own next-token distribution has a near tie at the first token that differs: FP8 activation
  rounding and TF32 matmuls move logits by about 1e-3, enough to flip a tie and nothing else. The
  test measures the CPU engine's top-2 log-probability margin there, so a real divergence (a wrong
  device path) fails it.
- Both runs compute in float32 (``Run.dtype``), so the comparison is of devices, not of dtypes.
- The train step on CUDA, from the same checkpoint on the same scored batch (routing replayed, so
  both take the same experts), has the CPU's loss and gradient norm within rounding.
- ``k3rl run --device cuda`` runs a whole iteration (in bfloat16: ``--dtype auto`` on CUDA) and
  records the per-stage device peaks."""

import dataclasses
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from prefect.logging import disable_run_logger

from k3core.rl.mismatch import engine_logprobs
from k3core.settings import GRPOSettings, RolloutSettings
from k3core.rl import engines, trainers
from tasks.common import Batch, Run
from tasks.fetch import fetch_checkpoint
from tasks.quantize import quantize_mxfp4
from tasks.rollout import rollout
from tasks.score import score_rewards
from tasks.train import train_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEAR_TIE = 0.1  # nats between the CPU's top two candidates: a flip below it is rounding's
ENV_MODULE = "even_bytes_env_for_device_tests"
# tests/even_bytes_env.py under this file's module name: the tiny random policy's reward varies on it
# (on "reverse" it scores 0 everywhere, and a batch of uniform groups trains nothing)
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("art"))
    engines.clear()
    trainers.clear()
    out = {}
    with disable_run_logger():
        for device in ("cpu", "cuda"):
            run = Run(root, f"dev-{device}", env="reverse", seed=0, device=device, dtype="float32")
            ck = fetch_checkpoint.fn(run, "init:tiny:1")
            out[device] = dict(run=run, ck=ck, weights=quantize_mxfp4.fn(run, ck))
    return out


def test_greedy_rollout_tokens_match_the_cpu(runs):
    greedy = RolloutSettings(prompts_per_iteration=8, samples_per_prompt=1, max_new_tokens=8, temperature=0.0)
    tables = {}
    with disable_run_logger():
        for device, r in runs.items():
            art = rollout.fn(r["run"], 0, r["weights"], greedy)
            tables[device] = pq.read_table(art.path).to_pylist()
    assert engines.get(runs["cuda"]["run"].run_id).device.type == "cuda"
    cpu_engine = engines.get(runs["cpu"]["run"].run_id)
    same, ties = 0, []
    for a, b in zip(tables["cpu"], tables["cuda"]):
        assert a["prompt_ids"] == b["prompt_ids"]
        if a["output_ids"] == b["output_ids"]:
            same += 1
            continue
        t = next(i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y)
        lp, _ = engine_logprobs(cpu_engine.model, [(a["prompt_ids"], a["output_ids"])], cpu_engine.pad_id)
        top2 = lp[0][t].topk(2).values
        ties.append(float(top2[0] - top2[1]))
    assert all(m < NEAR_TIE for m in ties), (
        f"{same} of {len(tables['cpu'])} greedy rollouts equal; CPU top-2 margins where they part: {ties}")


def test_train_step_loss_matches_the_cpu(runs, tmp_path, monkeypatch):
    # the eager regions: this compares devices; the compiled regions (the CUDA default) are compared
    # with the eager ones in test_packed_gpu.py, and their first backward compiles, which took past
    # this test's 300 s with eight test processes compiling at once on the H100
    import k3core.ops.compiled as regions

    monkeypatch.setattr(regions, "COMPILED", False)
    sampled = RolloutSettings(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=6, temperature=1.0)
    cpu = runs["cpu"]
    (tmp_path / f"{ENV_MODULE}.py").write_text(ENV_SRC)
    sys.path.insert(0, str(tmp_path))
    try:
        with disable_run_logger():
            ro = rollout.fn(cpu["run"], 1, cpu["weights"], sampled)
            scored = score_rewards.fn(dataclasses.replace(cpu["run"], env=f"{ENV_MODULE}:make"), 1, ro, GRPOSettings())
    finally:
        sys.path.remove(str(tmp_path))
    with disable_run_logger():
        assert scored.info["groups_informative"] > 0, "no group with differing rewards: nothing to train on"
        batch = Batch(sampled, 0, (ro,), (scored,))
        metrics = {d: train_step.fn(r["run"], 1, r["ck"], batch, GRPOSettings(lr=1e-3)).info["metrics"]
                   for d, r in runs.items()}
    live = trainers.peek(runs["cuda"]["run"].run_id, 2)
    assert live is not None and next(live.model.parameters()).device.type == "cuda"
    for key in ("loss", "grad_norm"):
        assert metrics["cuda"][key] == pytest.approx(metrics["cpu"][key], rel=1e-2, abs=1e-4), key


def test_k3rl_run_device_cuda_records_per_stage_device_peaks(tmp_path):
    from flows.cli import main
    from k3core.config import K3Config
    from k3core.plan import device_ledger

    rc = main(["run", "--device", "cuda", "--preset", "tiny", "--iterations", "1", "--run-id", "gpu",
               "--artifacts", str(tmp_path), "--warmup-steps", "2", "--prompts-per-iteration", "4",
               "--samples-per-prompt", "4", "--eval-prompts", "8", "--mismatch-sequences", "4"])
    assert rc == 0
    (m,) = json.loads((tmp_path / "runs" / "gpu" / "metrics.json").read_text())
    summary = json.loads((tmp_path / "runs" / "gpu" / "summary.json").read_text())
    assert m["device"] == summary["device"] == "cuda"
    assert m["dtype"] == summary["dtype"] == "bfloat16"  # --dtype auto on cuda
    ledger = device_ledger(K3Config.preset("tiny"))
    for stage in ("rollout", "mismatch", "train", "transfer"):
        assert m[f"memory_{stage}_device_peak_bytes"] >= m[f"memory_{stage}_device_bytes_after"] > 0, stage
    # the train step held the trainer's weights and gradients at once
    assert m["memory_train_device_peak_bytes"] >= ledger["trainer_weights"] + ledger["trainer_gradients"]
    # the rollout's decode state and activations are gone when it ends
    assert m["memory_rollout_device_bytes_after"] < m["memory_rollout_device_peak_bytes"]
    assert summary["memory_per_stage"]["prepare_quantize"]["device_peak_bytes"] > 0
