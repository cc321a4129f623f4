"""train_step: the GRPO updates (``ppo_epochs`` x ``minibatches``, PPO clipping, TIS correction,
routing replay, micro-batches) of the trainer state on a scored batch. The trained model and
optimizer stay live in this process (``k3core.rl.trainers``) and the step returns a handle of that
live state (``info["durable"]`` False); ``tasks.save.save_checkpoint`` writes it to disk, beside the
next iteration's rollout or every ``--save-every`` iterations, before the next update changes it.
A step whose trainer state is already published (a resumed run) returns that, and trains nothing.
With ``procs`` > 1 the step runs as a torchrun job of that many processes (``k3core.rl.fsdp``:
FSDP2, gloo), which write the trainer state together; the next stages then read it from disk.

Not cached by Prefect: a live state exists only in the process that trained it, so a re-run
finds the published state or trains again, never a record of a live state that is gone."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from prefect import get_run_logger

from k3core.artifacts import Artifact
from k3core.rl import trainers
from k3core.settings import GRPOSettings
from tasks.common import Batch, Run, read_table, stage


def _rel(run: Run, iteration: int) -> str:
    return run.layout.trainer_rel(iteration)


def _trainer(run: Run, state: Artifact, settings: GRPOSettings):
    """(model, optimizer, live trainer or None) at ``state`` with the model on the run's device: the
    live trainer (its saved RNG restored), or read from the trainer state (DCP), or a public-layout
    checkpoint with a fresh optimizer and the RNG seeded from the run's seed (the first iteration).
    The optimizer's state stays on the host (``StreamedAdamW``)."""
    from k3core.device import torch_dtype
    from k3core.rl.trainer_state import QAT_KEY, make_optimizer, set_qat, set_rng_state
    from k3core.rl.weights import load_policy

    if state.kind != "dcp":
        model = set_qat(load_policy(state.path, torch_dtype(run.dtype), device=run.device), settings.qat)
        _seed_first_trainer(run)
        return model, make_optimizer(model, settings.lr), None
    if trainers.unwritten(state) and trainers.peek(run.run_id, state.version) is None:
        raise RuntimeError(f"trainer state {state.uri} (version {state.version}) was never written and is not live in "
                           "this process: re-run the same command, which resumes from the last checkpoint")
    trainers.weights(run.run_id, state, run.device, run.dtype)  # live, or read once from the DCP state
    live = trainers.take(run.run_id, state.version)
    set_rng_state(live.rng)
    model, opt, extra = live.model, live.optimizer, live.extra
    was = bool(extra.get(QAT_KEY, False))
    if was != settings.qat:
        onoff = {True: "on", False: "off"}
        raise ValueError(f"trainer state {state.uri} was trained with QAT {onoff[was]}, this run asks for QAT "
                         f"{onoff[settings.qat]}: resume with --qat {str(was).lower()}, or start a new --run-id")
    return model, opt, live


def _seed_first_trainer(run: Run) -> None:
    """Seed the RNG (minibatch shuffles) of a trainer that starts from public-layout weights (the
    run's first iteration) from the run's seed; later iterations restore the RNG saved with their
    trainer state. Unseeded, it would hold whatever this process drew before: an uninterrupted run
    comes here straight after the warm-up, a resumed run (prepare's stages cached, or a process
    killed and restarted in between) does not, and their trainer states would differ."""
    import random

    import torch

    torch.manual_seed(run.seed)
    random.seed(run.seed)


@stage(run_name="train_step-iter{iteration}", key="train",
       outputs=lambda run, iteration, **_: [run.uri(_rel(run, iteration))],
       inputs=lambda state, batch, reference, **_: [state.uri, *(a.uri for a in batch.scored),
                                                    reference.uri if reference else ""],
       cache_policy=None, persist_result=False)
def train_step(run: Run, iteration: int, state: Artifact, batch: Batch, settings: GRPOSettings,
               reference: Artifact | None = None, procs: int = 1) -> Artifact:
    """``batch``: the iteration's scored rounds, trained on together, and the settings they were
    sampled with (the trainer's log-probabilities use their temperature; ``max_new_tokens`` is the
    constant of ``seq-sum`` aggregation; at most ``prompts_per_iteration`` informative groups are
    trained on). Per-update statistics go into the trainer state's ``extra.json``
    (``metrics.per_update``), and the data cursor where the next iteration starts
    (``data_cursor.position``: ``Batch.next_position``). ``reference``: the frozen reference's
    log-probabilities of the batch (``tasks.reference``), required when ``settings.kl_coef`` > 0.
    ``procs``: processes of the step (> 1: a torchrun job, the model sharded with FSDP2, on the CPU;
    the same update up to floating-point summation order); one process trains on the run's device."""
    import pyarrow as pa

    from k3core.rl.train import train_on_table
    from k3core.rl.trainer_state import QAT_KEY, WEIGHTS_FROM_MASTERS, WEIGHTS_KEY, rng_state

    rel, sampling = _rel(run, iteration), batch.sampling
    if settings.kl_coef and reference is None:
        raise ValueError(f"--kl-coef {settings.kl_coef} needs the reference's logprobs of iteration {iteration} "
                         "(the reference_logprobs stage); set --kl-coef 0 to train without the penalty")
    if procs > 1 and run.device != "cpu":
        raise ValueError(f"--train-procs {procs} runs the FSDP2 job on gloo (CPU); it cannot train on {run.device}")
    if run.store.exists(rel):  # written already (a resumed run): the update is not repeated
        return durable_handle(run, iteration)
    if procs > 1:
        def build(tmp):
            _log(iteration, _train_distributed(run, iteration, state, batch, settings, procs, tmp))

        run.store.publish_once(rel, build, is_dir=True)
        return durable_handle(run, iteration)
    model, opt, live = _trainer(run, state, settings)
    table = pa.concat_tables([read_table(a) for a in batch.scored])
    # the previous state may still be being written (``flows.pipeline.write_behind``): the first
    # optimizer step releases that write (the writer copies what it has not read yet) before it starts
    with trainers.update_after_write(live) if live is not None else contextlib.nullcontext({}) as waited:
        metrics = train_on_table(model, opt, table, settings, model.config.pad_token_id,
                                 temperature=sampling.temperature, seq_sum_norm=sampling.max_new_tokens,
                                 max_groups=sampling.prompts_per_iteration,
                                 reference=read_table(reference) if reference is not None else None)
    metrics.update(waited)
    trainers.written(run.run_id, state.version)  # released: the write reads the state no more
    extra = {**_lineage(iteration, state, batch), "reference": reference.uri if reference is not None else None,
             "metrics": metrics, QAT_KEY: bool(model.config.qat_routed_experts), WEIGHTS_KEY: WEIGHTS_FROM_MASTERS}
    trainers.put(run.run_id, trainers.LiveTrainer(iteration + 1, model, opt, extra, rng_state()))
    _log(iteration, metrics)
    return live_handle(run, iteration, state, batch, reference, extra)


def durable_handle(run: Run, iteration: int) -> Artifact:
    """The published trainer state of ``iteration`` (weight version ``iteration + 1``)."""
    from k3core.rl.trainer_state import QAT_KEY

    rel = _rel(run, iteration)
    extra = json.loads((run.store.open_local(rel) / "state" / "extra.json").read_text())
    return run.store.handle(rel, "dcp", version=iteration + 1, inner="state", metrics=extra["metrics"],
                            qat=bool(extra.get(QAT_KEY, False)))


def live_handle(run: Run, iteration: int, state: Artifact, batch: Batch, reference: Artifact | None,
                extra: dict) -> Artifact:
    """The handle of a trainer state that is live in this process and not written yet: the URI and
    path it will be published at, and for ``sha256`` a digest of what it was derived from (the parent
    state and the tables trained on), which a resumed run's retrained state shares."""
    import hashlib

    from k3core.rl.trainer_state import QAT_KEY

    rel = _rel(run, iteration)
    parts = [state.uri, state.sha256, *(f"{a.uri}:{a.sha256}" for a in batch.scored),
             f"{reference.uri}:{reference.sha256}" if reference is not None else ""]
    derived = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return Artifact(kind="dcp", uri=run.uri(rel), path=str(run.store.local_path(rel) / "state"), sha256=derived,
                    version=iteration + 1, info={"metrics": extra["metrics"], "qat": bool(extra.get(QAT_KEY, False)),
                                                 "durable": False, "next_position": batch.next_position})


def _lineage(iteration: int, state: Artifact, batch: Batch) -> dict:
    """What a trainer state records of where it came from, and the data cursor it resumes at."""
    return {"iteration": iteration + 1,
            "data_cursor": {"next_iteration": iteration + 1, "position": batch.next_position},
            "parent": state.uri, "scored": batch.scored[0].uri, "refills": [a.uri for a in batch.scored[1:]]}


def data_position(state: Artifact) -> int:
    """The data cursor a trainer state (or its checkpoint) recorded: where the next iteration's
    prompts start; 0 for a run's starting weights (not a trainer state)."""
    if state.kind != "dcp":
        return 0
    if "next_position" in state.info:  # a live state carries it
        return int(state.info["next_position"])
    extra = json.loads((Path(state.path) / "extra.json").read_text())
    return int(extra.get("data_cursor", {}).get("position", 0))


def _log(iteration: int, metrics: dict) -> None:
    procs = f" on {metrics['train_procs']} FSDP2 ranks" if metrics.get("train_procs", 1) > 1 else ""
    get_run_logger().info(f"iteration {iteration}: {metrics.get('updates', 0)} updates{procs}, loss "
                          f"{metrics.get('loss', 0):.4f}, grad norm {metrics.get('grad_norm', 0):.3f}, clip fraction "
                          f"{metrics.get('clip_fraction', 0):.3f}, approx KL {metrics.get('approx_kl', 0):.2e}, "
                          f"{metrics.get('groups_dropped', 0)} of {metrics.get('groups_sampled', 0)} groups uniform (dropped)")


def _train_distributed(run: Run, iteration: int, state: Artifact, batch: Batch, settings: GRPOSettings, procs: int,
                       tmp) -> dict:
    """The train step as a torchrun job of ``procs`` ranks writing the trainer state into ``tmp/state``.
    A public-layout start (the first iteration) takes this process's RNG state, as the one-process
    step would; a DCP state restores its own."""
    import dataclasses
    import tempfile

    import torch

    from k3core.rl.fsdp import TrainJob, run_train_job
    from k3core.rl.trainer_state import rng_state

    trainers.take(run.run_id, state.version)  # the ranks train from the durable state; drop the stale live copy
    sampling = batch.sampling
    with tempfile.TemporaryDirectory(prefix="k3rl-train-job-") as work:
        rng = None
        if state.kind != "dcp":
            _seed_first_trainer(run)
            rng = f"{work}/rng.pt"
            torch.save(rng_state(), rng)
        job = TrainJob(state=str(state.path), state_kind="dcp" if state.kind == "dcp" else "public",
                       tables=[str(a.path) for a in batch.scored], grpo=dataclasses.asdict(settings),
                       out=str(tmp / "state"), temperature=sampling.temperature, seq_sum_norm=sampling.max_new_tokens,
                       max_groups=sampling.prompts_per_iteration, rng=rng, dtype=run.dtype,
                       extra=_lineage(iteration, state, batch))
        return run_train_job(job, procs, work)["metrics"]
