"""The FSDP2 train step under torchrun (k3core.rl.fsdp) against the one-process train step.

The reference is the plain path the pipeline runs in one process: ``train_on_table`` on an
unsharded model with ``StreamedAdamW``. Two gloo ranks on the CPU (real torchrun, loopback
rendezvous) must give the same loss, statistics and weights up to the order of floating-point
sums. Trainer states cross world sizes: the 2-rank state is read by one process, and a state
saved by one process is trained on by 2 ranks.
"""

import copy
import dataclasses
import random

import pyarrow.parquet as pq
import pytest
import torch

from k3core.rl.prompting import PromptFormat
from k3core.checkpoint.hf import init_checkpoint
from k3core.rl.data import training_prompts
from k3core.rl.envs import ReverseEnv
from k3core.rl.fsdp import TrainJob, TrainJobError, run_train_job
from k3core.rl.tables import rollout_table, score_table
from k3core.rl.train import micro_batches, train_on_table
from k3core.rl.trainer_state import load_trainer_state, make_optimizer, save_trainer_state
from k3core.rl.weights import engine_from_model, load_policy
from k3core.rollout.engine import SamplingParams
from k3core.settings import GRPOSettings
from k3core.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(600)


class EvenBytes(ReverseEnv):
    """A reward a random tiny policy varies on (every group informative, so every step trains)."""

    def reward(self, prompt, completion):
        data = completion.encode()
        return sum(b % 2 == 0 for b in data) / len(data) if data else 0.0


def _scored(tmp_path, model, seed):
    tok = ByteTokenizer(model.config)
    env = EvenBytes()
    engine = engine_from_model(copy.deepcopy(model).eval(), 0, quantized=False)
    params = SamplingParams(max_new_tokens=7, temperature=1.0, n=4, stop_token_ids=(tok.eos_id,), seed=seed)
    rollouts = rollout_table(engine, PromptFormat.of(tok, mode="raw"), training_prompts(env, seed, 0, 4, "reverse"), params, 0)
    table, stats = score_table(rollouts, env, "even-bytes", 4)
    assert stats["groups_informative"] == 4
    path = tmp_path / f"scored-{seed}.parquet"
    pq.write_table(table, path)
    return table, str(path)


def _same_step(ref: dict, got: dict, ref_model, got_model, start_model):
    """Same statistics (every update's) and weights, up to float summation order."""
    assert got["train_procs"] == 2 and got["updates"] == ref["updates"] and got["micro_batches"] == ref["micro_batches"]
    assert got["tokens"] == ref["tokens"] and got["sequences"] == ref["sequences"]
    for r, g in zip(ref["per_update"], got["per_update"]):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-3, abs=1e-6)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
        assert g["clip_fraction"] == pytest.approx(r["clip_fraction"], abs=1.5 / r["tokens"])  # one token may flip
        assert (g["tokens"], g["sequences"]) == (r["tokens"], r["sequences"])
    assert got["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    before, want, have = start_model.state_dict(), ref_model.state_dict(), got_model.state_dict()
    assert want.keys() == have.keys()
    update = max((want[k] - before[k]).abs().max().item() for k in want if want[k].is_floating_point())
    assert update > 1e-4, "the step must move the weights for this comparison to mean anything"
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=0, atol=0.02 * update, msg=k)


@pytest.mark.slow  # three torchrun jobs of 2 fresh interpreters each: about a minute on the shared 2-core CPU
def test_two_ranks_equal_one_process_and_states_cross_world_sizes(tmp_path):
    torch.set_num_threads(1)
    init_checkpoint("tiny", tmp_path / "ckpt", seed=0)
    start = load_policy(tmp_path / "ckpt")
    pad = ByteTokenizer(start.config).pad_id
    table, scored = _scored(tmp_path, start, seed=3)

    # 1. one on-policy step (the pipeline's default), from the public checkpoint
    one = GRPOSettings(lr=1e-3)
    torch.manual_seed(11)
    random.seed(11)
    torch.save((torch.get_rng_state(), random.getstate()), tmp_path / "rng.pt")
    ref = copy.deepcopy(start)
    opt = make_optimizer(ref, one.lr)
    ref_m = train_on_table(ref, opt, table, one, pad, seq_sum_norm=7, max_groups=4)
    job = TrainJob(state=str(tmp_path / "ckpt"), state_kind="public", tables=[scored], grpo=dataclasses.asdict(one),
                   out=str(tmp_path / "fsdp-1"), seq_sum_norm=7, max_groups=4, rng=str(tmp_path / "rng.pt"),
                   extra={"iteration": 1})
    extra = run_train_job(job, 2, tmp_path / "work-1")
    assert extra["iteration"] == 1
    got, _, got_extra = load_trainer_state(job.out, lr=0.0)  # saved by 2 ranks, read by one process
    assert got_extra["metrics"] == extra["metrics"]
    _same_step(ref_m, extra["metrics"], ref, got, start)

    # 2. a state saved by one process, trained by 2 ranks: 2 epochs x 2 minibatches (logp_old taken first,
    #    shuffles from the state's RNG), packed micro-batches of one sequence (a budget below every
    #    length), so rank 1 joins every micro-batch with a zero-weight stand-in
    table2, scored2 = _scored(tmp_path, ref, seed=4)
    multi = GRPOSettings(lr=1e-3, ppo_epochs=2, minibatches=2, micro_batch_tokens=1, packing=True)
    lengths = [len(p) + len(o) - 1 for p, o in zip(table2.column("prompt_ids").to_pylist(),
                                                   table2.column("output_ids").to_pylist())]
    assert all(len(mb) == 1 for mb in micro_batches(lengths, 1, packed=True))
    save_trainer_state(tmp_path / "ref-1", ref, opt, {"iteration": 1})
    before = copy.deepcopy(ref)
    ref_m2 = train_on_table(ref, opt, table2, multi, pad, seq_sum_norm=7, max_groups=4)
    job2 = TrainJob(state=str(tmp_path / "ref-1"), state_kind="dcp", tables=[scored2], grpo=dataclasses.asdict(multi),
                    out=str(tmp_path / "fsdp-2"), seq_sum_norm=7, max_groups=4)
    extra2 = run_train_job(job2, 2, tmp_path / "work-2")
    got2, _, _ = load_trainer_state(job2.out, lr=0.0)
    _same_step(ref_m2, extra2["metrics"], ref, got2, before)
    assert ref_m2["clip_fraction"] > 0  # later updates were off-policy: the clip engaged on both sides


def test_a_failing_rank_fails_the_job_with_its_output(tmp_path):
    """A job whose state is missing ends with TrainJobError carrying the ranks' error, not a hang."""
    job = TrainJob(state=str(tmp_path / "missing"), state_kind="dcp", tables=[], grpo=dataclasses.asdict(GRPOSettings()),
                   out=str(tmp_path / "out"))
    with pytest.raises(TrainJobError, match="config.json"):
        run_train_job(job, 2, tmp_path / "work", timeout=300)
