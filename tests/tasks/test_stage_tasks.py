"""Each stage body on the tiny preset, called directly (no Prefect server): outputs, schemas, and
bad inputs that must fail clearly and leave earlier artifacts intact."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from prefect.logging import disable_run_logger

from k3core.artifacts import Artifact
from k3core.rl.data import ROLLOUT_SCHEMA, SCORED_SCHEMA
from k3core.settings import GRPOSettings, RolloutSettings
from k3core.rl import engines, trainers
from tasks.common import Batch, Run
from tasks.fetch import fetch_checkpoint
from tasks.quantize import quantize_mxfp4
from tasks.rollout import rollout
from tasks.save import save_checkpoint
from tasks.score import score_rewards
from tasks.train import train_step
from tasks.transfer import transfer_weights
from tasks.validate import validate_checkpoint


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """fetch -> validate -> quantize -> rollout -> score -> train -> save -> transfer, once."""
    root = str(tmp_path_factory.mktemp("art"))
    run = Run(root, "t", env="add", seed=0)
    engines.clear()
    trainers.clear()
    with disable_run_logger():
        ck = fetch_checkpoint.fn(run, "init:tiny:1")
        rep = validate_checkpoint.fn(run, ck, "tiny")
        w = quantize_mxfp4.fn(run, ck)
        sampling = RolloutSettings(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=5)
        ro = rollout.fn(run, 0, w, sampling)
        sc = score_rewards.fn(run, 0, ro, GRPOSettings())
        t = pq.read_table(sc.path)
        tr = train_step.fn(run, 0, ck, Batch(sampling, 0, (ro,), (sc,)), GRPOSettings(lr=1e-3))
        sv = save_checkpoint.fn(run, 0, tr)
        xf = transfer_weights.fn(run, 0, sv, quantized=False)
    return dict(root=root, run=run, ck=ck, rep=rep, w=w, ro=ro, sc=sc, tr=tr, sv=sv, xf=xf, table=t)


def test_fetch_and_validate(pipeline):
    ck, rep = pipeline["ck"], pipeline["rep"]
    assert Path(ck.path, "model.safetensors.index.json").exists()
    report = json.loads(Path(rep.uri.removeprefix("file://")).read_text())
    assert report and rep.kind == "report" and rep.info["checkpoint_sha256"] == ck.sha256


def test_quantized_weights_are_mxfp4_release_layout(pipeline):
    idx = json.loads(Path(pipeline["w"].path, "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.endswith("experts.0.w1.weight_packed") for k in idx)
    assert any(k.endswith("experts.0.w1.weight_scale") for k in idx)
    cfg = json.loads(Path(pipeline["w"].path, "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"


def test_rollout_and_scored_parquet_schemas(pipeline):
    ro = pq.read_table(pipeline["ro"].path)
    sc = pq.read_table(pipeline["sc"].path)
    assert ro.schema.equals(ROLLOUT_SCHEMA) and sc.schema.equals(SCORED_SCHEMA)
    assert ro.num_rows == 16
    r = ro.to_pylist()[0]
    assert len(r["logprobs"]) == len(r["output_ids"]) >= 1
    from k3core.config import K3Config

    c = K3Config.preset("tiny")
    positions = len(r["prompt_ids"]) + len(r["output_ids"]) - 1
    assert len(r["routing"]) == positions * len(c.moe_layers) * c.num_experts_per_token
    # group-normalised advantages: zero mean per group of 4
    adv = torch.tensor(sc.column("advantage").to_pylist()).view(-1, 4)
    torch.testing.assert_close(adv.mean(1), torch.zeros(4), atol=1e-5, rtol=0)


def test_save_publishes_manifest_and_latest(pipeline):
    sv = pipeline["sv"]
    man = json.loads(Path(sv.info["manifest"].removeprefix("file://")).read_text())
    assert man["iteration"] == 1 and man["files"]
    # each file's digest is its bytes' (hashlib, read here), though the commit took them from the
    # trained state's handle by inode (k3core.artifacts.published_sha256)
    import hashlib

    for rel, digest in man["files"].items():
        assert hashlib.sha256((Path(sv.path) / rel).read_bytes()).hexdigest() == digest, rel
    latest = json.loads(Path(pipeline["root"], "runs/t/latest.json").read_text())
    assert latest["checkpoint"] == sv.uri


def test_latest_only_moves_forward(pipeline):
    """The last iteration commits its own state while the save of the one before, written behind it,
    may still be finishing: whichever commits last, ``latest`` ends at the newer version."""
    from k3core.artifacts import ArtifactStore
    from tasks.save import _pointed_at

    root, run, sv = pipeline["root"], pipeline["run"], pipeline["sv"]
    latest = Path(root, "runs/t/latest.json")
    before = latest.read_text()
    newer = json.loads(before) | {"version": 7, "iteration": 7}
    latest.write_text(json.dumps(newer))
    try:
        with disable_run_logger():
            save_checkpoint.fn(run, 0, pipeline["tr"])  # version 1 again, after 7: committed, latest untouched
        assert json.loads(latest.read_text())["version"] == 7
        assert _pointed_at(ArtifactStore(root), "runs/t/latest.json") == 7
    finally:
        latest.write_text(before)
    assert json.loads(latest.read_text())["checkpoint"] == sv.uri


def test_after_transfer_engine_logprobs_equal_trainer(pipeline):
    """Without quantization the engine (cached AttnRes scores, cached decode) reproduces the trainer."""
    from k3core.rl.trainer_state import load_trainer_state
    eng = engines.get("t")
    assert eng.weight_version == pipeline["sv"].version == 1
    model, _, _ = load_trainer_state(pipeline["sv"].path, lr=0.0)
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        want = model(ids[:, :-1], targets=ids[:, 1:], return_logprobs=True).logprobs
        got = eng.model(ids[:, :-1], targets=ids[:, 1:], return_logprobs=True).logprobs
    assert torch.equal(want, got)


def test_transfer_without_refresh_leaves_stale_attnres_cache(pipeline):
    """The regression a naive online update hits: skip the w*gamma refresh and logits change."""
    from k3core.rl.trainer_state import load_trainer_state
    from k3core.rl.weights import engine_state
    eng = engines.get("t")
    model, _, _ = load_trainer_state(pipeline["sv"].path, lr=0.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("_res_proj.weight", "_res_norm.weight")):
                p.add_(torch.randn_like(p))
    ids = torch.randint(0, 256, (1, 6))
    eng.load_weights(engine_state(model, False), 99, refresh=False)
    with torch.no_grad():
        stale = eng.model(ids).logits
        eng.model.refresh_inference_caches()
        fresh = eng.model(ids).logits
        want = model(ids).logits
    assert torch.equal(fresh, want)
    assert not torch.allclose(stale, want)
    engines.clear()


def test_transfer_refuses_mismatched_weights(pipeline):
    from k3core.rl.weights import build_engine
    eng = build_engine(pipeline["ck"].path, 0)
    sd = {k: v.clone() for k, v in eng.model.state_dict().items()}
    before = eng.model.lm_head.weight.clone()
    bad = dict(sd)
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="refused"):
        eng.load_weights(bad, 5)
    assert eng.weight_version == 0 and torch.equal(eng.model.lm_head.weight, before)


def test_bad_inputs_fail_clearly_and_keep_artifacts(pipeline, tmp_path):
    root = pipeline["root"]
    with disable_run_logger():
        with pytest.raises(ValueError, match="unknown preset"):
            fetch_checkpoint.fn(Run(str(tmp_path), "x"), "init:huge:0")
        with pytest.raises(ValueError, match="unknown environment"):
            score_rewards.fn(Run(root, "t", env="no-such-env"), 9, pipeline["ro"], GRPOSettings())
        # a corrupt checkpoint: a truncated shard fails validation and publishes no report
        import shutil

        bad = tmp_path / "bad"
        shutil.copytree(pipeline["ck"].path, bad)
        shard = next(bad.glob("model-*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:-100])
        from k3core.checkpoint.validate import CheckpointValidationError

        with pytest.raises(CheckpointValidationError):
            validate_checkpoint.fn(Run(str(tmp_path), "bad"), Artifact("hf", "file:///bad", str(bad), "x"), "tiny")
        assert not (tmp_path / "runs" / "bad" / "source.validation.json").exists()
        with pytest.raises(CheckpointValidationError):
            validate_checkpoint.fn(Run(str(tmp_path), "m"), Artifact("hf", "file:///m", str(tmp_path / "missing"), "x"),
                                   "tiny")
    # earlier artifacts are intact
    assert pq.read_table(pipeline["sc"].path).schema.equals(SCORED_SCHEMA)
