"""train_step with ``procs=2`` (a torchrun FSDP2 job launched by the task) against ``procs=1`` (the
one-process step, the reference), from the same checkpoint and scored batch: the same trainer state
up to rounding, published the same way, with the process's RNG handed to the job (the minibatch
shuffle draws from it)."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from prefect.logging import disable_run_logger

from k3core.rl.prompting import PromptFormat
from k3core.artifacts import Artifact, sha256_file
from k3core.rl.data import training_prompts
from k3core.rl.envs import ReverseEnv
from k3core.rl.tables import rollout_table, score_table
from k3core.rl.trainer_state import load_trainer_state
from k3core.rl.weights import build_engine
from k3core.rollout.engine import SamplingParams
from k3core.settings import GRPOSettings, RolloutSettings
from k3core.tokenizer import ByteTokenizer
from k3core.rl import trainers
from tasks.common import Batch, Run
from tasks.fetch import fetch_checkpoint
from tasks.save import write_trainer_state
from tasks.train import train_step


class EvenBytes(ReverseEnv):
    def reward(self, prompt, completion):
        data = completion.encode()
        return sum(b % 2 == 0 for b in data) / len(data) if data else 0.0


@pytest.mark.slow  # one torchrun job of 2 fresh interpreters: ~20 s on the shared 2-core CPU
def test_train_step_as_two_process_fsdp_job_equals_one_process(tmp_path):
    torch.set_num_threads(1)
    trainers.clear()
    sampling = RolloutSettings(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=5)
    settings = GRPOSettings(lr=1e-3, minibatches=2)
    with disable_run_logger():
        ck = fetch_checkpoint.fn(Run(str(tmp_path / "src"), "src"), "init:tiny:1")
        engine = build_engine(ck.path, 0)
        tok = ByteTokenizer(engine.model.config)
        env = EvenBytes()
        params = SamplingParams(max_new_tokens=5, temperature=1.0, n=4, stop_token_ids=(tok.eos_id,), seed=9)
        table, stats = score_table(rollout_table(engine, PromptFormat.of(tok, mode="raw"), training_prompts(env, 0, 0, 4, "reverse"), params, 0),
                                   env, "even-bytes", 4)
        assert stats["groups_informative"] == 4
        pq.write_table(table, tmp_path / "scored.parquet")
        scored = Artifact(kind="scored", uri=(tmp_path / "scored.parquet").as_uri(), path=str(tmp_path / "scored.parquet"),
                          sha256=sha256_file(tmp_path / "scored.parquet"), version=0)
        states, paths = {}, {}
        for procs in (1, 2):  # both seed the minibatch shuffle from the run's seed (0): the same draws
            run = Run(str(tmp_path / f"art{procs}"), f"p{procs}")
            states[procs] = train_step.fn(run, 0, ck, Batch(sampling, 0, (), (scored,)), settings, procs=procs)
            paths[procs] = write_trainer_state(run, 0, states[procs])  # one process leaves it live: written here
    one, two = states[1], states[2]
    assert two.kind == one.kind == "dcp" and two.version == one.version == 1
    assert two.info["metrics"]["train_procs"] == 2 and two.info["metrics"]["updates"] == 2
    for a, b in zip(one.info["metrics"]["per_update"], two.info["metrics"]["per_update"]):
        assert b["sequences"] == a["sequences"] and b["tokens"] == a["tokens"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
    assert one.info["durable"] is False and "durable" not in two.info  # the torchrun job wrote its state
    extra = json.loads(Path(two.path, "extra.json").read_text())
    assert extra["iteration"] == 1 and extra["parent"] == ck.uri and extra["scored"] == scored.uri
    want = load_trainer_state(paths[1], lr=0.0)[0].state_dict()
    got = load_trainer_state(paths[2], lr=0.0)[0].state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-5, msg=k)
