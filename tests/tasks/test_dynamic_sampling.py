"""Dynamic sampling through the stages: a refill round is a rollout and a score of new prompts on the
same weights, in files of their own, its groups numbered after the first round's; the train step
drops the uniform groups of every round and trains on at most ``prompts_per_iteration`` of the rest;
the flow's ``refill`` loop stops at the target or at ``--refill-rounds``."""

import dataclasses
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from prefect.logging import disable_run_logger

from k3core.settings import GRPOSettings, RLSettings, RolloutSettings
from k3core.rl import engines, trainers
from tasks.common import Batch, Run

ENV_MODULE = "even_bytes_env_for_refill_tests"
# the even-bytes environment of tests/even_bytes_env.py, under this test file's own module name
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()
P, G = 8, 2  # two samples of one token each: a group is uniform about half the time


def _informative(table) -> int:
    rewards = {}
    for r in table.to_pylist():
        rewards.setdefault(r["prompt_index"], set()).add(r["reward"])
    return sum(len(v) > 1 for v in rewards.values())


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    from tasks.fetch import fetch_checkpoint
    from tasks.rollout import rollout
    from tasks.score import score_rewards

    root = tmp_path_factory.mktemp("refill")
    (root / f"{ENV_MODULE}.py").write_text(ENV_SRC)
    sys.path.insert(0, str(root))
    run = Run(str(root / "art"), "d", env=f"{ENV_MODULE}:make", seed=0)
    sampling = RolloutSettings(prompts_per_iteration=P, samples_per_prompt=G, max_new_tokens=1, quantized=False)
    engines.clear()
    trainers.clear()
    try:
        with disable_run_logger():
            ck = fetch_checkpoint.fn(run, "init:tiny:1")
            ro0 = rollout.fn(run, 0, ck, sampling)
            sc0 = score_rewards.fn(run, 0, ro0, GRPOSettings())
            ro1 = rollout.fn(run, 0, ck, sampling, 1)
            sc1 = score_rewards.fn(run, 0, ro1, GRPOSettings(), refill=1)
        yield dict(run=run, sampling=sampling, ck=ck, ro0=ro0, sc0=sc0, ro1=ro1, sc1=sc1)
    finally:
        engines.clear()
        trainers.clear()
        sys.path.remove(str(root))


def test_a_refill_round_samples_new_prompts_into_its_own_files(rounds):
    from k3core.rl.data import training_prompts
    from k3core.rl.envs import load_env

    run = rounds["run"]
    t0, t1 = pq.read_table(rounds["ro0"].path), pq.read_table(rounds["ro1"].path)
    assert rounds["ro0"].path.endswith("iter-0000/rollouts.parquet")
    assert rounds["ro1"].path.endswith("iter-0000/rollouts-refill1.parquet")
    assert rounds["sc1"].path.endswith("iter-0000/scored-refill1.parquet")
    assert sorted(set(t0.column("prompt_index").to_pylist())) == list(range(P))
    assert sorted(set(t1.column("prompt_index").to_pylist())) == list(range(P, 2 * P))  # after round 0's
    env = load_env(run.env)
    assert t0.column("prompt").to_pylist()[::G] == training_prompts(env, 0, 0, P, run.env)  # round 0 unchanged
    assert t1.column("prompt").to_pylist()[::G] == training_prompts(env, 0, 0, P, run.env, refill=1)
    assert set(t0.column("prompt").to_pylist()) != set(t1.column("prompt").to_pylist())
    for sc in (rounds["sc0"], rounds["sc1"]):
        assert sc.info["groups"] == P
        assert sc.info["groups_informative"] == _informative(pq.read_table(sc.path))


def test_train_step_trains_on_every_round_up_to_the_batch_size(rounds):
    from tasks.save import write_trainer_state
    from tasks.train import train_step

    inf0, inf1 = rounds["sc0"].info["groups_informative"], rounds["sc1"].info["groups_informative"]
    assert 0 < inf0 < P and inf1 > 0, "the case needs a first round short of informative groups"
    with disable_run_logger():
        batch = Batch(rounds["sampling"], 0, (rounds["ro0"], rounds["ro1"]), (rounds["sc0"], rounds["sc1"]))
        tr = train_step.fn(rounds["run"], 0, rounds["ck"], batch, GRPOSettings(lr=1e-3))
    m = tr.info["metrics"]
    trained = min(P, inf0 + inf1)
    assert m["groups_sampled"] == 2 * P and m["groups_dropped"] == 2 * P - inf0 - inf1
    assert m["groups_trained"] == trained and m["groups_unused"] == inf0 + inf1 - trained
    assert m["sequences"] == G * trained
    assert tr.info["durable"] is False  # live: the save writes it
    with disable_run_logger():
        extra = json.loads((write_trainer_state(rounds["run"], 0, tr) / "extra.json").read_text())
    assert extra["refills"] == [rounds["sc1"].uri] and extra["scored"] == rounds["sc0"].uri
    assert [u["sequences"] for u in extra["metrics"]["per_update"]] == [G * trained]  # one update, its statistics
    assert extra["data_cursor"] == {"next_iteration": 1, "position": 2 * P}  # past both rounds' prompts


def test_the_refill_loop_stops_at_the_target_or_the_cap(rounds, prefect_harness):
    from flows.pipeline import refill

    run = rounds["run"]
    s = RLSettings.from_dict({"preset": "tiny", "env": run.env, "artifacts": run.artifacts, "run_id": run.run_id,
                              "rollout": dataclass_dict(rounds["sampling"]), "refill_rounds": 3})
    first = Batch(rounds["sampling"], 0, (rounds["ro0"],), (rounds["sc0"],))
    enough = Batch(rounds["sampling"], 0, (rounds["ro0"],), (dataclasses.replace(
        rounds["sc0"], info={**rounds["sc0"].info, "groups_informative": P}),))
    assert refill(s, run, 0, rounds["ck"], enough) == enough  # enough already: no extra rollout
    assert refill(s.replace(refill_rounds=0), run, 0, rounds["ck"], first) == first
    engines.clear()
    with disable_run_logger():
        batch = refill(s, run, 0, rounds["ck"], first)
    out = list(zip(batch.rollouts[1:], batch.scored[1:]))
    assert 1 <= len(out) <= 3 and batch.rollouts[0] == rounds["ro0"]
    counts = [sc.info["groups_informative"] for sc in batch.scored]
    assert sum(counts[:-1]) < P  # every round ran because the earlier ones fell short
    assert sum(counts) >= P or len(out) == 3  # it stopped at the target or at the cap
    assert batch.next_position == (1 + len(out)) * P  # the next iteration's prompts follow every round's
    for r, (ro, sc) in enumerate(out, start=1):
        assert ro.produced_by == f"rollout-iter0-refill{r}" and sc.produced_by == f"score_rewards-iter0-refill{r}"
        assert sc.inputs == (ro.uri,) and Path(sc.path).name == f"scored-refill{r}.parquet"
    # round 1 again: the stage found its published file, the same rows
    assert pq.read_table(out[0][1].path).equals(pq.read_table(rounds["sc1"].path))
    assert torch.tensor(pq.read_table(out[0][1].path).column("reward").to_pylist()).numel() == P * G


def dataclass_dict(x):
    return dataclasses.asdict(x)
