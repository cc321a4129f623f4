"""Per-iteration metrics in TensorBoard and MLflow (``--tensorboard``, ``--mlflow-uri``): a real tiny
run, then the same run continued. References: TensorBoard's own event reader (``EventAccumulator``,
which applies the purge a resumed writer asks for) and MLflow's client reading its sqlite store,
both against ``metrics.json``."""

import json
import math
from pathlib import Path

import pytest

from flows.pipeline import RLSettings, rl_run
from k3core.rl import engines, trainers

pytest.importorskip("tensorboardX")
pytest.importorskip("mlflow")


def _settings(tmp: Path, iterations: int) -> RLSettings:
    return RLSettings.from_dict(dict(
        preset="tiny", source="init:tiny:3", iterations=iterations, artifacts=str(tmp / "root"), run_id="tracked",
        prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=4, warmup_steps=2, warmup_batch=8,
        eval_prompts=8, eval_every=2, tensorboard=str(tmp / "tb"), mlflow_uri=f"sqlite:///{tmp / 'mlflow.db'}"))


def _tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _mlflow(uri: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("k3rl")
    (run,) = client.search_runs([exp.experiment_id], "tags.`k3rl.run_id` = 'tracked'")
    assert run.data.params["grpo.lr"] and run.info.run_name == "tracked"
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
            for k in run.data.metrics}, run.info.status


def _expected(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for step, row in enumerate(metrics):
        for k, v in {**row, "iteration": step}.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out.setdefault(k, []).append((step, float(v)))
    return out


def _same(got, want, rel: float):
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    assert all(math.isclose(a, b, rel_tol=rel, abs_tol=1e-6) for (_, a), (_, b) in zip(got, want)), (got, want)


@pytest.mark.slow
def test_metrics_reach_tensorboard_and_mlflow_once_per_iteration_across_a_continued_run(tmp_path, prefect_harness):
    for iterations in (2, 3):  # the second call continues the run: iteration 2 only
        engines.clear()
        trainers.clear()
        summary = rl_run(_settings(tmp_path, iterations))
        metrics = json.loads((tmp_path / "root" / "runs" / "tracked" / "metrics.json").read_text())
        want = _expected(metrics)
        tb = _tensorboard(tmp_path / "tb" / "tracked")
        ml, status = _mlflow(f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert len(metrics) == iterations and status == "FINISHED"
        for name, series in want.items():
            _same(tb[name], series, rel=1e-6)  # TensorBoard scalars are float32
            _same(ml[name], series, rel=1e-12)
        extra = set(tb) - set(want)  # the summary's numbers at step = iterations
        assert extra == set(ml) - set(want) and extra and all(k.startswith("final/") for k in extra), extra
        assert tb["final/heldout_reward_end"][-1] == (iterations, pytest.approx(summary["heldout_reward_end"], rel=1e-6))
    # one point per iteration in both: the continued run logged iteration 2 and nothing twice
    assert [s for s, _ in tb["reward_mean"]] == [s for s, _ in ml["reward_mean"]] == [0, 1, 2]


def test_a_tracker_whose_package_or_store_is_unusable_is_named_before_any_work(tmp_path, monkeypatch, capsys):
    import sys

    from flows.cli import main

    base = ["run", "--preset", "tiny", "--run-id", "t", "--artifacts", str(tmp_path / "root"), "--iterations", "1"]
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    assert main([*base, "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert "--tensorboard" in err and "pip install 'k3rl[trackers]'" in err and "Traceback" not in err, err
    assert main([*base, "--mlflow-uri", "bogus+scheme://nowhere"]) == 2
    err = capsys.readouterr().err
    assert "--mlflow-uri bogus+scheme://nowhere" in err and "Traceback" not in err, err
    assert not (tmp_path / "root" / "runs" / "t").exists()
