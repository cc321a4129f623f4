"""The doorway between flows and tasks: an environment is loaded before any stage runs (a bad one
fails with nothing written; one that follows the protocol without ``reference`` skips the warm-up
with a notice), stages declare their lineage where they are defined (the task run name, the URIs
published and read, stamped on the returned ``Artifact``), and a stage call is timed."""

from __future__ import annotations

import logging
import re
import textwrap

import pytest

from k3core.artifacts import Artifact
from k3core.settings import RLSettings, RolloutSettings
from tasks.common import Batch, Run, stage_timings

PLUGIN_SRC = textwrap.dedent('''
    class Minimal:
        """Only what the documented protocol requires: prompts and reward, no reference."""
        def prompts(self, rng, n):
            return ["rev:" + "".join(rng.choice("ab") for _ in range(3)) + "=" for _ in range(n)]
        def reward(self, prompt, completion):
            return 1.0 if completion.strip() == prompt[4:-1][::-1] else 0.0

    def make():
        return Minimal()
''')


def _settings(root, run_id, env, **kw):
    return RLSettings.from_dict(dict(preset="tiny", source="init:tiny:0", env=env, iterations=0, artifacts=str(root),
                                     run_id=run_id, warmup_steps=3, warmup_batch=4, **kw))


def test_a_bad_environment_fails_before_any_stage(tmp_path, prefect_harness):
    from flows.pipeline import prepare

    with pytest.raises(ValueError, match="cannot import module 'no_such_env_module'"):
        prepare(_settings(tmp_path, "bad", "no_such_env_module:make"))
    assert not (tmp_path / "runs").exists()  # nothing fetched, nothing written


def test_a_protocol_environment_without_reference_skips_the_warmup(tmp_path, monkeypatch, prefect_harness, caplog):
    from flows.pipeline import prepare

    (tmp_path / "minimal_env_for_seam_tests.py").write_text(PLUGIN_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        prep = prepare(_settings(tmp_path / "art", "plug", "minimal_env_for_seam_tests:make", quantized_rollouts=False))
    assert "has no reference(prompt): skipping the supervised warm-up" in caplog.text
    assert prep.policy == prep.checkpoint == prep.weights
    assert not (tmp_path / "art" / "runs" / "plug" / "warmup").exists()
    assert set(prep.seconds) == {"fetch", "validate"}
    assert [a.produced_by for a in prep.lineage()] == ["fetch_checkpoint", "validate_checkpoint"]


def test_a_stage_declares_its_lineage_where_it_is_defined(tmp_path):
    from tasks.rollout import rollout
    from tasks.train import train_step

    run = Run(str(tmp_path), "r", env="add")
    w = Artifact("hf-mxfp4", run.uri(run.rel("rollout-weights-v0")), "/unused", "0" * 64, version=3)
    task, name, inputs = rollout.task(run, 3, w, RolloutSettings())
    assert name == "rollout-iter3" and inputs == [w.uri]
    assert [a.key for a in task.assets] == [(tmp_path / "runs/r/iter-0003/rollouts.parquet").as_uri()]
    assert task.retries >= 1 and task.cache_policy is not None and task.persist_result
    state = Artifact("dcp", run.uri(run.rel("checkpoints", "iter-0003")), "/unused", "1" * 64, version=3)
    scored = Artifact("scored", run.uri(run.iter_rel(3, "scored.parquet")), "/unused", "2" * 64, version=3)
    from k3core.settings import GRPOSettings
    from tasks.score import score_rewards

    task, name, inputs = train_step.task(run, 3, state, Batch(RolloutSettings(), 0, (), (scored,)), GRPOSettings())
    assert name == "train_step-iter3" and inputs == [state.uri, scored.uri]
    assert [a.key for a in task.assets] == [(tmp_path / "runs/r/iter-0003/trainer").as_uri()]
    # a dynamic-sampling refill round: the same stages under their own run names, files and inputs
    task, name, inputs = rollout.task(run, 3, w, RolloutSettings(), 2)
    assert name == "rollout-iter3-refill2" and inputs == [w.uri]
    assert [a.key for a in task.assets] == [(tmp_path / "runs/r/iter-0003/rollouts-refill2.parquet").as_uri()]
    ro2 = Artifact("rollouts", run.uri(run.iter_rel(3, "rollouts-refill2.parquet")), "/unused", "3" * 64, version=3)
    task, name, inputs = score_rewards.task(run, 3, ro2, GRPOSettings(), refill=2)
    assert name == "score_rewards-iter3-refill2" and inputs == [ro2.uri]
    assert [a.key for a in task.assets] == [(tmp_path / "runs/r/iter-0003/scored-refill2.parquet").as_uri()]
    assert score_rewards.task(run, 3, ro2, GRPOSettings())[1] == "score_rewards-iter3"
    sc2 = Artifact("scored", run.uri(run.iter_rel(3, "scored-refill2.parquet")), "/unused", "4" * 64, version=3)
    _, _, inputs = train_step.task(run, 3, state, Batch(RolloutSettings(), 0, (), (scored, sc2)), GRPOSettings())
    assert inputs == [state.uri, scored.uri, sc2.uri]
    # after iteration 0 the engine serves weights a transfer pushed: the transfer materializes them as
    # an asset, and rollouts and evaluations name that asset, not the checkpoint it came from
    from tasks.evaluate import evaluate
    from tasks.transfer import transfer_weights

    task, name, inputs = transfer_weights.task(run, 3, state, True)
    assert [a.key for a in task.assets] == ["engine://r@v3"] and inputs == [state.uri]
    assert rollout.task(run, 4, state, RolloutSettings())[2] == ["engine://r@v3"]
    assert rollout.task(run, 4, state, RolloutSettings(), 1)[2] == ["engine://r@v3"]
    assert evaluate.task(run, "iter4", state, 4, RolloutSettings())[2] == ["engine://r@v3"]


def test_a_stage_call_is_stamped_and_timed(tmp_path, prefect_harness):
    from tasks.fetch import fetch_checkpoint
    from tasks.validate import validate_checkpoint

    run = Run(str(tmp_path), "s")
    with stage_timings() as seconds:
        ck = fetch_checkpoint(run, "init:tiny:2")
        rep = validate_checkpoint(run, ck, "tiny")
    assert ck.produced_by == "fetch_checkpoint" and ck.inputs == () and ck.info["source"] == "init:tiny:2"
    assert rep.produced_by == "validate_checkpoint" and rep.inputs == (ck.uri,)
    assert set(seconds) == {"fetch", "validate"} and all(v > 0 for v in seconds.values())
    # and with the id of the task run that produced it, which the lineage table links to
    from uuid import UUID

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_task_run(UUID(ck.produced_by_id)).name == "fetch_checkpoint"
        assert client.read_task_run(UUID(rep.produced_by_id)).name == "validate_checkpoint"
    # a second call of the same stage is a cache hit returning the same artifact
    with stage_timings():
        again = fetch_checkpoint(run, "init:tiny:2")
    assert again == ck


def test_lineage_rows_link_to_their_task_runs_and_inputs_to_their_producers(tmp_path):
    from flows.reports import lineage_markdown

    s = _settings(tmp_path, "ln", "add")
    run = Run(str(tmp_path), "ln")
    ck = Artifact("dcp", run.uri(run.checkpoint_rel(1)), "/x", "a" * 64, version=1, info={"manifest": "m"},
                  produced_by="save_checkpoint-iter0", produced_by_id="11111111-1111-1111-1111-111111111111")
    eng = Artifact("engine", run.engine_uri(1), "", "b" * 64, version=1, produced_by="transfer_weights-iter0",
                   inputs=(ck.uri,), produced_by_id="22222222-2222-2222-2222-222222222222")
    ro = Artifact("rollouts", run.uri(run.iter_rel(1, "rollouts.parquet")), "/x", "c" * 64, version=1,
                  produced_by="rollout-iter1", inputs=(eng.uri,))  # no orchestrator: no link
    md = lineage_markdown(s, [ck, eng, ro])
    md = re.sub(r"\]\([^)]*?/runs/task-run/", "](/runs/task-run/", md)  # the UI's address, when configured
    rows = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| `")}
    assert "[save_checkpoint-iter0](/runs/task-run/1111" in rows["| `checkpoints/iter-0001`"]
    eng_row = rows["| `engine://ln@v1`"]
    assert "[transfer_weights-iter0](/runs/task-run/2222" in eng_row
    assert "[checkpoints/iter-0001](/runs/task-run/1111" in eng_row  # the input, linked to its producer
    ro_row = rows["| `iter-0001/rollouts.parquet`"]
    assert "| rollout-iter1 |" in ro_row and "[engine://ln@v1](/runs/task-run/2222" in ro_row
