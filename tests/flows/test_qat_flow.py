"""QAT as a pipeline setting (``RLSettings.qat``, ``k3rl run --qat``): the switch reaches the trainer
(the first train step's loss and gradient differ from a run without it on the same rollouts), survives
the reload of the trainer state across iterations and a resume, is refused when a resume asks for the
other setting, is recorded in the run's metrics and lineage, and never reaches the exported weights
(plain public names, no flag in config.json). The resumed trainer's expert forward equals the forward
of plain experts holding dequantize(quantize(w))."""

import copy
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from prefect.artifacts import Artifact

from flows.cli import _settings_from_args, build_parser
from flows.pipeline import RLSettings, rl_run
from k3core.checkpoint.hf import save_hf
from k3core.model.moe import RoutedExperts
from k3core.ops.mxfp4 import dequantize, quantize
from k3core.rl.trainer_state import load_trainer_state
from k3core.rl import engines

ENV_MODULE = "even_bytes_env_for_qat_tests"
# the even-bytes environment of tests/even_bytes_env.py, under this test file's own module name
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()


def _settings(root: Path, run_id: str, **kw) -> RLSettings:
    base = dict(preset="tiny", source="init:tiny:5", env=f"{ENV_MODULE}:make", iterations=1, artifacts=str(root),
                run_id=run_id, prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=4, warmup_steps=0,
                eval_prompts=4, eval_every=0, mismatch_sequences=0, lr=1e-3)
    base.update(kw)
    return RLSettings.from_dict(base)


def _run(s: RLSettings) -> list[dict]:
    engines.clear()
    rl_run(s)
    return json.loads((Path(s.pipeline.artifacts) / "runs" / s.pipeline.run_id / "metrics.json").read_text())


def _latest_trainer(root: Path, run_id: str):
    latest = json.loads((root / "runs" / run_id / "latest.json").read_text())
    return load_trainer_state(Path(latest["checkpoint"].removeprefix("file://")) / "state", lr=0.0)


def _names(ckpt: Path) -> set[str]:
    return set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"])


def test_cli_flag_sets_the_setting():
    p = build_parser()
    assert _settings_from_args(p.parse_args(["run", "--qat"])).grpo.qat is True
    assert _settings_from_args(p.parse_args(["run", "--qat", "false"])).grpo.qat is False
    assert _settings_from_args(p.parse_args(["run"])).grpo.qat is False
    with pytest.raises(SystemExit):
        p.parse_args(["run", "--qat", "maybe"])


@pytest.mark.slow
def test_qat_setting_reaches_the_trainer_survives_resume_and_stays_out_of_exports(tmp_path, monkeypatch,
                                                                                  prefect_harness):
    (tmp_path / f"{ENV_MODULE}.py").write_text(ENV_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))

    off = _run(_settings(tmp_path / "off", "plain"))
    on = _run(_settings(tmp_path / "on", "qat", qat=True))
    # same rollouts (same v0 weights and seeds), so the first step differs only by QAT
    rel = "iter-0000/rollouts.parquet"
    assert pq.read_table(tmp_path / "off" / "runs" / "plain" / rel).equals(
        pq.read_table(tmp_path / "on" / "runs" / "qat" / rel))
    assert off[0]["skipped"] == on[0]["skipped"] == 0.0
    assert on[0]["loss"] != off[0]["loss"] and on[0]["grad_norm"] != off[0]["grad_norm"]
    assert off[0]["qat"] is False and on[0]["qat"] is True

    # resume the QAT run for one more iteration: the trainer reloaded from the DCP state keeps QAT
    on = _run(_settings(tmp_path / "on", "qat", qat=True, iterations=2))
    assert [m["qat"] for m in on] == [True, True]
    latest, _, extra = _latest_trainer(tmp_path / "on", "qat")
    assert extra["iteration"] == 2 and extra["qat_routed_experts"] is True
    assert latest.config.qat_routed_experts is True
    stacks = [m for m in latest.modules() if isinstance(m, RoutedExperts)]
    assert stacks and all(m.qat for m in stacks)
    plain_state = _latest_trainer(tmp_path / "off", "plain")[0]
    assert not plain_state.config.qat_routed_experts and not any(
        m.qat for m in plain_state.modules() if isinstance(m, RoutedExperts))

    # the run's lineage (the rl-lineage artifact) says which trainer states trained with QAT
    from flows.reports import artifact_key

    lineage = Artifact.get(artifact_key("lineage", "qat")).data
    assert lineage.count("| trainer state (QAT: MXFP4 routed experts) |") == 2

    # a resume asking for the other setting is refused, naming the fix
    engines.clear()
    with pytest.raises(ValueError, match=r"trained with QAT on, this run asks for QAT off: resume with --qat true"):
        rl_run(_settings(tmp_path / "on", "qat", qat=False, iterations=3))

    # export: the plain public names of the run's own public checkpoints (the bf16 source, the MXFP4
    # rollout weights v0), and no flag in config.json
    run = tmp_path / "on" / "runs" / "qat"
    for target, same_as in (("bf16", "source"), ("mxfp4", "rollout-weights-v0")):
        out = save_hf(latest, tmp_path / f"export-{target}", target=target).path
        assert "qat_routed_experts" not in (out / "config.json").read_text()
        ref = next((run / same_as).rglob("model.safetensors.index.json")).parent
        assert _names(out) == _names(ref), target
    assert any(n.endswith("experts.0.w1.weight") for n in _names(tmp_path / "export-bf16"))


def test_resumed_qat_expert_forward_equals_round_tripped_weights(tmp_path):
    """Unit level, on a trainer state saved with QAT and loaded back: every routed-expert stack's
    forward equals plain experts holding dequantize(quantize(w)), and differs from the raw weights."""
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.trainer_state import make_optimizer, save_trainer_state, set_qat
    torch.manual_seed(0)
    model = set_qat(K3ForCausalLM(K3Config.preset("tiny")), True)
    save_trainer_state(tmp_path / "s", model, make_optimizer(model, 1e-3), {"iteration": 1})
    assert "qat_routed_experts" not in (tmp_path / "s" / "config.json").read_text()
    loaded = load_trainer_state(tmp_path / "s", lr=0.0)[0]
    stacks = [m for m in loaded.modules() if isinstance(m, RoutedExperts)]
    assert stacks
    for m in stacks:
        ref = copy.deepcopy(m)
        ref.qat = False
        raw = copy.deepcopy(ref)
        with torch.no_grad():
            for w in (ref.w13, ref.w2):
                w.copy_(dequantize(*quantize(w), dtype=w.dtype))
        E, Dl = m.num_experts, m.w2.shape[1]
        counts = torch.tensor([3, 0, 5] + [2] * (E - 3))
        x = torch.randn(int(counts.sum()), Dl)
        with torch.no_grad():
            assert torch.equal(m.grouped_forward(x, counts), ref.grouped_forward(x, counts))
            assert torch.equal(m.expert_forward(2, x[:4]), ref.expert_forward(2, x[:4]))
            assert not torch.allclose(m.grouped_forward(x, counts), raw.grouped_forward(x, counts))
