"""Scheduled ticks cost the same on tick 10 as on tick 2: ``rl_continue`` (what the schedule runs)
adds one iteration per tick without replaying the past ones, so the Prefect flow runs and artifact
versions each tick creates stay constant (a replayed run made a new subflow per past iteration and
republished every report, so its counts grew with every tick). Embedded Prefect, tiny preset."""

from datetime import datetime, UTC

import pytest

from flows.deploy import iterations_done, rl_continue
from k3core.settings import RLSettings
from k3core.rl import engines, trainers

TICKS = 10


def _counts():
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        artifacts, page = 0, 200  # the API's page limit
        while len(client.read_artifacts(limit=page, offset=artifacts)) == page:
            artifacts += page
        return client.count_flow_runs(), artifacts + len(client.read_artifacts(limit=page, offset=artifacts))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ten_ticks_create_the_same_flow_runs_and_artifacts_each(tmp_path, prefect_harness):
    tiny = RLSettings.from_dict(dict(preset="tiny", env="add", prompts_per_iteration=2, samples_per_prompt=2,
                                     max_new_tokens=3, warmup_steps=1, warmup_batch=4, eval_prompts=4, eval_every=1,
                                     mismatch_sequences=0))
    root = str(tmp_path)
    per_tick = []
    # the embedded server is shared by the tests of one xdist worker: what is read below is only
    # what this test made (other tests' runs also have fetch_checkpoint task runs and rl_continue
    # flow runs)
    t0 = datetime.now(UTC)
    before = _counts()
    for tick in range(TICKS):
        engines.clear()  # each tick is a fresh process on a worker
        trainers.clear()
        rl_continue(run_id="ticks", artifacts=root, iterations_per_tick=1, settings=tiny)
        assert iterations_done(root, "ticks") == tick + 1
        after = _counts()
        per_tick.append((after[0] - before[0], after[1] - before[1]))
        before = after
    flow_runs, artifacts = zip(*per_tick)
    # tick 1 also prepares the run; from tick 2 on every tick is the same work
    assert len(set(flow_runs[1:])) == 1, flow_runs
    assert len(set(artifacts[1:])) == 1, artifacts
    assert flow_runs[1] <= 4, flow_runs  # rl_continue, rl_run, prepare (all cached), rl_iteration
    # prepare's stages ran once: every later tick's is a cache hit (which records no materialization
    # event), and the lineage names the task runs of the first tick, the ones that made the artifacts
    import json
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    lineage = json.loads((Path(root) / "runs" / "ticks" / "lineage.json").read_text())
    made = {a["produced_by"]: a["produced_by_id"] for a in lineage["prepare"]}
    with get_client(sync_client=True) as client:
        for name in ("fetch_checkpoint", "validate_checkpoint", "warmup", "quantize_mxfp4"):
            runs = [r for r in client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[name])))
                    if r.created >= t0]
            states = sorted(r.state.name for r in runs)
            assert len(runs) == TICKS and states == ["Cached"] * (TICKS - 1) + ["Completed"], (name, states)
            first = next(r for r in runs if r.state.name == "Completed")
            assert made[name] == str(first.id), (name, made[name])
        # each tick's own flow run (rl_continue) carries a note linking to the run's reports
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        notes = [n for n in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["rl-tick-ticks"])))
                 if n.created >= t0]
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName

        ticks = {str(f.id) for f in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rl_continue"])))
                 if f.created >= t0}
        assert len(notes) == TICKS and {str(n.flow_run_id) for n in notes} == ticks, (len(notes), len(ticks))
        assert all("/artifacts/key/rl-metrics-ticks" in n.data for n in notes)
        done = sorted(int(n.data.split("`: ")[1].split()[0]) for n in notes)  # "### run `ticks`: N iterations done"
        assert done == list(range(1, TICKS + 1)), done
