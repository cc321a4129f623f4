"""``--dtype`` (``k3core.device.compute_dtype``; ``Run.dtype`` carries it to every stage) on the CPU.

- Resolution: ``auto`` is bf16 on CUDA and fp32 on the CPU; a named dtype wins; a bad one is refused
  naming the choices, in the settings and in ``compute_dtype``.
- A trainer state is device- and dtype-portable (a deployment's ticks may change device, and with
  ``auto`` the dtype with it): an fp32 trainer state read as bf16 holds the fp32 weights rounded to
  bf16 (the independent reference: ``Tensor.to``), keeps the fp32-only parameters (KDA ``A_log``) and
  the optimizer's fp32 master weights exactly, and reads back as fp32 bit for bit.
- The bf16 train step against the fp32 one on the same scored batch: the same gradient norm to
  bf16's rounding, and the live trainer and the engine it feeds hold bf16 weights."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from prefect.logging import disable_run_logger

from k3core import device as D
from k3core.settings import GRPOSettings, RLSettings, RolloutSettings, SettingsError
from k3core.rl import engines, trainers
from tasks.common import Batch, Run

ENV_MODULE = "even_bytes_env_for_dtype_tests"
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()


def test_auto_is_bf16_on_cuda_and_fp32_on_the_cpu_and_bad_names_are_refused(monkeypatch):
    assert D.compute_dtype("cuda") == "bfloat16" and D.compute_dtype("cpu") == "float32"
    assert D.compute_dtype("cuda", "float32") == "float32" and D.compute_dtype("cpu", "bfloat16") == "bfloat16"
    assert D.torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'auto'"):
        D.torch_dtype("auto")  # a resolved name only: auto means nothing without a device
    with pytest.raises(ValueError, match="--dtype must be one of auto, float32, bfloat16"):
        D.compute_dtype("cpu", "fp16")
    with pytest.raises(SettingsError, match="--dtype: unknown dtype 'half'; choose one of auto, float32, bfloat16"):
        RLSettings.from_dict({"dtype": "half"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.run_dtype(RLSettings()) == "float32"
    assert D.run_dtype(RLSettings.from_dict({"dtype": "bfloat16"})) == "bfloat16"
    assert RLSettings.from_dict({"device": {"type": "cpu", "dtype": "bfloat16"}}).device.dtype == "bfloat16"
    # FSDP2 refuses mixed parameter dtypes ("FSDP expects uniform original parameter dtype"), and bf16
    # keeps A_log/dt_bias in fp32: refused before any work, with the fix
    with pytest.raises(SettingsError, match="--dtype bfloat16 with --train-procs > 1.*use --dtype float32"):
        RLSettings.from_dict({"dtype": "bfloat16", "train_procs": 2})


def test_an_fp32_trainer_state_reads_as_bf16_and_back(tmp_path):
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.trainer_state import load_trainer_state, make_optimizer, save_trainer_state

    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(3)
    opt = make_optimizer(model, 1e-3)
    save_trainer_state(tmp_path / "s", model, opt, {"iteration": 1})
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    bf, bf_opt, _ = load_trainer_state(tmp_path / "s", lr=0.0, dtype=torch.bfloat16)
    assert trainers.dtype_of(bf) == torch.bfloat16
    kept = 0
    for n, p in bf.named_parameters():
        if p.dtype == torch.float32:  # the release's fp32 parameters (KDA A_log, dt_bias, ...)
            kept += 1
            assert torch.equal(p, ref[n]), n
        else:
            assert p.dtype == torch.bfloat16 and torch.equal(p, ref[n].to(torch.bfloat16)), n
    assert kept > 0
    masters = [s["master"] for s in bf_opt.state.values()]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    by_id = {id(p): n for n, p in bf.named_parameters()}
    for p, s in bf_opt.state.items():
        assert torch.equal(s["master"].view(ref[by_id[id(p)]].shape), ref[by_id[id(p)]]), by_id[id(p)]
    back, _, _ = load_trainer_state(tmp_path / "s", lr=0.0, dtype=torch.float32)
    assert all(torch.equal(p, ref[n]) for n, p in back.named_parameters())


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    from tasks.fetch import fetch_checkpoint
    from tasks.rollout import rollout
    from tasks.score import score_rewards

    root = tmp_path_factory.mktemp("dtype")
    (root / f"{ENV_MODULE}.py").write_text(ENV_SRC)
    sys.path.insert(0, str(root))
    engines.clear()
    trainers.clear()
    sampling = RolloutSettings(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=6, quantized=False)
    try:
        with disable_run_logger():
            run = Run(str(root / "art"), "fp32", env=f"{ENV_MODULE}:make", seed=0)
            ck = fetch_checkpoint.fn(run, "init:tiny:1")
            ro = rollout.fn(run, 0, ck, sampling)
            sc = score_rewards.fn(run, 0, ro, GRPOSettings())
        assert sc.info["groups_informative"] > 0
        yield dict(run=run, ck=ck, scored=sc, batch=Batch(sampling, 0, (ro,), (sc,)))
    finally:
        engines.clear()
        trainers.clear()
        sys.path.remove(str(root))


def test_the_bf16_train_step_matches_fp32_to_bf16_rounding(scored):
    from tasks.rollout import engine_for
    from tasks.train import train_step

    metrics = {}
    with disable_run_logger():
        for dtype in ("float32", "bfloat16"):
            run = dataclasses.replace(scored["run"], run_id=f"train-{dtype}", dtype=dtype)
            art = train_step.fn(run, 0, scored["ck"], scored["batch"], GRPOSettings(lr=1e-3))
            metrics[dtype] = art.info["metrics"]
            live = trainers.peek(run.run_id, 1)
            assert trainers.dtype_of(live.model) == getattr(torch, dtype)
            eng = engine_for(run, art)
            assert trainers.dtype_of(eng.model) == getattr(torch, dtype)
    assert metrics["float32"]["updates"] == metrics["bfloat16"]["updates"] > 0
    # one on-policy update: the loss is ~0 by construction (ratio 1, advantages summing to 0 per group:
    # 2e-8 in fp32, -3.5e-5 in bf16 here), so the gradient norm carries the comparison: measured
    # 4.1196 (fp32) against 4.1297 (bf16), 2.5e-3 apart; bf16 rounds weights and activations at 2^-9
    assert abs(metrics["bfloat16"]["loss"] - metrics["float32"]["loss"]) < 1e-3
    assert metrics["bfloat16"]["grad_norm"] == pytest.approx(metrics["float32"]["grad_norm"], rel=1e-2)


def test_a_worker_engine_takes_the_runs_dtype(scored):
    """Dask and Ray workers build their resident engines in the run's dtype (``ShardRequest.dtype``),
    as the embedded engine does: from a public checkpoint, and pushed from a trainer state."""
    from k3core.rl.shards import ResidentEngines
    from tasks.save import write_trainer_state
    from tasks.train import train_step

    holder = ResidentEngines()
    ck = scored["ck"]
    eng = holder.engine("w", ck.path, ck.kind, 0, False, "bfloat16")
    assert trainers.dtype_of(eng.model) == torch.bfloat16
    with disable_run_logger():
        run = dataclasses.replace(scored["run"], run_id="worker-bf16", dtype="bfloat16")
        state = train_step.fn(run, 0, ck, scored["batch"], GRPOSettings(lr=1e-3))
        path = write_trainer_state(run, 0, state)  # the train step leaves it live; a worker reads it from disk
    pushed = holder.engine("w", str(path), state.kind, 1, False, "bfloat16")
    assert pushed is eng and eng.weight_version == 1 and trainers.dtype_of(eng.model) == torch.bfloat16
    assert trainers.dtype_of(ResidentEngines().engine("w", ck.path, ck.kind, 0, False).model) == torch.float32
