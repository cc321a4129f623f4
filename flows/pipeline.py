"""The RL pipeline as Prefect flows: ``prepare`` (fetch, validate, warm-up, quantize), ``rl_iteration``
(rollout, score, train, save, transfer) and ``rl_run`` (prepare + N iterations + reports).

Every stage is a task declared in ``tasks/`` (its retries, cache policy and lineage live there) that
publishes its artifacts atomically under ``<artifacts>/runs/<run_id>/`` and is cached on its inputs
and source, so re-running ``rl_run`` with the same run id resumes after the last finished stage:
nothing finished is recomputed, no rollout batch is lost. Stages hand each other ``Artifact``
handles. One iteration N (engine at weight version N):

    rollout(engine@N) -> rollouts.parquet -> score -> scored.parquet -> train_step(state N) -> state N+1
    -> save_checkpoint (manifest, latest) -> transfer_weights (MXFP4 experts) -> engine@N+1

With ``--refill-rounds`` (dynamic sampling), rollout and score run again on new prompts
(``rollouts-refill1.parquet``, ...) while too few groups carry signal, before the train step.

With ``--kl-coef`` > 0, ``reference_logprobs`` computes the frozen reference's (the run's starting
policy) log-probabilities of the batch (``ref-logprobs.parquet``) for the train step's KL penalty.

With ``--max-staleness 1`` (one-step-off-policy), iteration N's batch was sampled by version N-1:
iteration N submits the rollout of N+1 on the engine at version N to the flow's task runner, trains
beside it, and joins it before the transfer moves the engine to N+1. A batch sampled ahead is a
published artifact like any other: a resumed run finds it and trains on it, never samples it again.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from flows import reports
from flows.retention import prune_checkpoints
from flows.scale import iteration_runner
from k3core.artifacts import Artifact
from k3core.settings import RLSettings
from tasks.common import Run, memory_metrics, progress_event, stage_memory, stage_timings
from tasks.evaluate import evaluate
from tasks.fetch import fetch_checkpoint
from tasks.mismatch import rollout_mismatch
from tasks.quantize import quantize_mxfp4
from tasks.reference import reference_logprobs
from tasks.rollout import rollout, rollout_fanout, rollout_refill, serve_version
from tasks.save import save_checkpoint
from tasks.score import fans_out, score_fanout, score_refill, score_rewards
from tasks.train import data_position, train_step
from tasks.transfer import transfer_weights
from tasks.validate import validate_checkpoint
from tasks.warmup import warmup

__all__ = ["Iteration", "Prepared", "RLSettings", "check_environment", "prepare", "refill", "rl_iteration", "rl_run",
           "rollout_of", "run_of", "score_of"]


def run_of(s: RLSettings) -> Run:
    from k3core.device import run_dtype

    return Run(s.pipeline.artifacts, s.pipeline.run_id, s.pipeline.env, s.pipeline.seed, run_dtype(s), s.rollout.decode)


def device_of(s: RLSettings) -> str:
    """The device every stage of the run computes on ("cpu" or "cuda"); ``--device cuda`` on a machine
    without one raises ``DeviceUnavailable`` (a ``ValueError``) before any stage runs, and so does
    ``--decode graph`` where the run computes on the CPU (``--device auto`` without a GPU)."""
    from k3core.device import decode_mode, run_device

    device = run_device(s).type
    decode_mode(device, s.rollout.decode)
    return device


def check_environment(s: RLSettings) -> bool:
    """Load the run's environment before any stage runs (a bad spec raises ``ValueError`` naming it);
    return whether the warm-up runs: it needs ``reference(prompt)``, which the protocol makes
    optional, so an environment without it skips the warm-up with a notice."""
    from k3core.rl.envs import load_env

    env = load_env(s.pipeline.env)
    if s.warmup.steps > 0 and not callable(getattr(env, "reference", None)):
        get_run_logger().warning(f"environment {s.pipeline.env!r} has no reference(prompt): skipping the supervised "
                                 "warm-up (RL starts from the fetched checkpoint; --warmup-steps 0 silences this)")
        return False
    return s.warmup.steps > 0


@dataclass
class Prepared:
    checkpoint: Artifact
    report: Artifact
    policy: Artifact  # the trainer's starting weights (warmed up, or the checkpoint)
    weights: Artifact  # the rollout engine's weights at version 0
    seconds: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int | str] = field(default_factory=dict)  # memory_metrics of the prepare stages

    def lineage(self) -> list[Artifact]:
        out = [self.checkpoint, self.report]
        out += [a for a, prev in ((self.policy, self.checkpoint), (self.weights, self.policy)) if a.uri != prev.uri]
        return out


@dataclass
class Iteration:
    policy: Artifact  # the trainer state after the update (version N+1)
    weights: Artifact  # what the engine serves next (version N+1)
    metrics: dict
    lineage: list[Artifact]
    next_rollouts: Artifact | None = None  # the next iteration's batch, sampled ahead at this version


@flow(name="prepare", flow_run_name="{settings.pipeline.run_id}-prepare", log_prints=True)
def prepare(settings: RLSettings) -> Prepared:
    """fetch -> validate -> (supervised warm-up) -> quantize (MXFP4 rollout weights, version 0)."""
    s, run = settings, run_of(settings)
    device = device_of(s)
    warm = check_environment(s)
    with stage_timings() as seconds, stage_memory() as peaks:
        checkpoint = fetch_checkpoint(run, s.model.source)
        report = validate_checkpoint(run, checkpoint, s.model.preset)
        policy = warmup(run, checkpoint, s.warmup, device=device) if warm else checkpoint
        weights = quantize_mxfp4(run, policy, device=device) if s.rollout.quantized else policy
    return Prepared(checkpoint, report, policy, weights, seconds, memory_metrics(peaks))


@flow(name="rl_iteration", flow_run_name="{settings.pipeline.run_id}-iter{iteration}", log_prints=True,
      task_runner=ThreadPoolTaskRunner(max_workers=2))
def rl_iteration(settings: RLSettings, iteration: int, policy: Artifact, weights: Artifact,
                 reference: Artifact | None = None, rollouts: Artifact | None = None,
                 behind: Artifact | None = None) -> Iteration:
    """One iteration: rollout, score, train, save, transfer. ``policy``: the trainer's weights at the
    version the engine serves (``weights``); ``reference``: the frozen policy of the KL penalty
    (``kl_coef`` > 0). One-step-off-policy: ``rollouts``, this iteration's batch when the previous
    iteration sampled it ahead; else it is sampled here by ``behind`` (the version before
    ``weights``; a resumed run finds it published) or, with neither, by ``weights`` (iteration 0)."""
    s, run = settings, run_of(settings)
    device = device_of(s)
    cursor = data_position(policy)  # where this iteration's prompts start (datasets), as the trainer state says
    t0 = time.perf_counter()
    ahead = s.grpo.max_staleness > 0 and iteration + 1 < s.pipeline.iterations
    with stage_timings() as seconds, stage_memory() as peaks:
        heldout = (evaluate(run, f"iter{iteration}", weights, s.evaluation.prompts, s.rollout, s.reward, device=device)
                   if s.evaluation.due(iteration) else {})
        if rollouts is None:
            rollouts = rollout_of(s, run, iteration, behind or weights, cursor=cursor, device=device)
        scored = score_of(s, run, iteration, rollouts)
        refills = refill(s, run, iteration, weights, scored.info["groups_informative"], cursor, device)
        if ahead:  # the next batch, at this version, beside the stages up to the save; its prompts follow this one's
            serve_version(run.run_id, weights, s.rollout.url, device, run.dtype, run.decode)
            pending = rollout.submit(run, iteration + 1, weights, s.rollout,
                                     cursor=cursor + s.rollout.prompts_per_iteration * (1 + len(refills)),
                                     device=device)
        mismatch = (rollout_mismatch(run, iteration, policy, rollouts, s.evaluation.mismatch_sequences,
                                     s.rollout.temperature, device=device)
                    if s.rollout.quantized and s.evaluation.mismatch_due(iteration) else {})
        batch = (scored, *(sc for _, sc in refills))
        ref = (reference_logprobs(run, iteration, reference, batch, s.grpo, s.rollout, device=device)
               if s.grpo.kl_coef else None)
        trained = train_step(run, iteration, policy, scored, s.grpo, s.rollout, batch[1:], cursor, ref,
                             procs=s.scale_out.train_procs, device=device)
        checkpoint = save_checkpoint(run, iteration, trained)
        next_rollouts = pending.result() if ahead else None  # the engine keeps this version until it is done
        engine = transfer_weights(run, iteration, checkpoint, s.rollout.quantized, device=device)
    metrics = reports.iteration_metrics(iteration, weights, rollouts, scored, trained, engine, heldout, mismatch, seconds)
    metrics.update(sampling_rounds=1 + len(refills), weight_version=rollouts.version, policy_version=iteration,
                   staleness=iteration - rollouts.version, seconds_iteration=time.perf_counter() - t0,
                   device=device, dtype=run.dtype, **memory_metrics(peaks))
    served = _served(s, checkpoint)
    extra = [a for pair in refills for a in pair] + ([ref] if ref is not None else [])
    return Iteration(checkpoint, served, metrics, [rollouts, scored, *extra, trained, checkpoint, engine],
                     next_rollouts)


def rollout_of(s: RLSettings, run: Run, iteration: int, weights: Artifact, refill: int = 0,
               cursor: int = 0, device: str = "cpu") -> Artifact:
    """The rollout (or refill round ``refill``) in this process on ``device``, or fanned out as
    shards over the task runner's engine workers (``--task-runner dask|ray``, CPU engines): the same
    table either way."""
    if s.scale_out.task_runner != "local":
        return rollout_fanout(run, iteration, weights, s.rollout, s.scale_out.rollout_workers, refill, cursor)
    if refill:
        return rollout_refill(run, iteration, weights, s.rollout, refill, cursor, device=device)
    return rollout(run, iteration, weights, s.rollout, cursor=cursor, device=device)


def score_of(s: RLSettings, run: Run, iteration: int, rollouts: Artifact, refill: int = 0) -> Artifact:
    """Rewards and advantages of a rollout (or of refill round ``refill``) in this process, or with a
    sandboxed environment's reward calls fanned out over the task runner's workers
    (``--task-runner dask|ray``): the same table either way."""
    if s.scale_out.task_runner != "local" and fans_out(run):
        return score_fanout(run, iteration, rollouts, s.rollout.samples_per_prompt, s.grpo.scale_advantages, refill,
                            s.reward, s.scale_out.rollout_workers)
    if refill:
        return score_refill(run, iteration, rollouts, s.rollout.samples_per_prompt, s.grpo.scale_advantages, refill,
                            s.reward)
    return score_rewards(run, iteration, rollouts, s.rollout.samples_per_prompt, s.grpo.scale_advantages,
                         reward=s.reward)


def refill(s: RLSettings, run: Run, iteration: int, weights: Artifact,
           informative: int, cursor: int = 0, device: str = "cpu") -> list[tuple[Artifact, Artifact]]:
    """Dynamic sampling: while fewer than ``prompts_per_iteration`` groups have rewards that differ
    (``informative`` so far), one more round of new prompts on the same weights, at most
    ``refill_rounds``. -> (rollouts, scored) of each round, in order."""
    out = []
    for r in range(1, s.grpo.refill_rounds + 1):
        if informative >= s.rollout.prompts_per_iteration:
            break
        rollouts = rollout_of(s, run, iteration, weights, r, cursor, device)
        scored = score_of(s, run, iteration, rollouts, r)
        informative += scored.info["groups_informative"]
        out.append((rollouts, scored))
    return out


@flow(name="rl_run", flow_run_name="{settings.pipeline.run_id}", log_prints=True)
def rl_run(settings: RLSettings = RLSettings()) -> dict:
    """prepare, then ``iterations`` RL iterations, then a final held-out evaluation and the run's
    reports (metrics table, lineage, curves, links). Re-running a run id continues it: iterations
    recorded as finished (``metrics.json``, ``lineage.json``, their checkpoint) are not replayed, and
    within an unfinished iteration the cached stages skip their finished work. A run whose summary
    already covers ``iterations`` returns that summary and runs nothing (its records stay as they
    were). With ``keep_checkpoints`` N, older checkpoints are deleted after each iteration
    (``flows/retention.py``)."""
    log = get_run_logger()
    s, run = settings, run_of(settings)
    recorded = reports.finished_summary(s)
    if recorded is not None:  # nothing to do: no stage, transfer or evaluation runs, no record is rewritten
        log.info(f"run '{run.run_id}' finished its {recorded['iterations']} iterations already: nothing to do "
                 f"(its records are under runs/{run.run_id}/; a larger --iterations continues it)")
        return recorded
    t_start = time.perf_counter()
    device = device_of(s)  # --device cuda without a GPU fails here, before any stage
    log.info(f"run '{run.run_id}': stages compute on {device} (--device {s.device.type})")
    progress_event("iterations", done=0, total=s.pipeline.iterations)
    prep = prepare(s)
    history, done = reports.finished_iterations(s)  # a continued run starts after its last recorded iteration
    done_before = len(done)
    progress_event("iterations", done=len(done), total=s.pipeline.iterations)
    policy, weights = prep.policy, prep.weights
    behind = pending = None  # one-step-off-policy: the previous version's weights; a batch sampled ahead
    if done:
        # the recorded handles name the local paths of the machine that made them; on another machine,
        # or after its cache was emptied, the checkpoints read here are downloaded from the root again
        checkpoints = [next(a for a in it if a.kind == "dcp" and "manifest" in a.info) for it in done]
        policy = run.store.localize(checkpoints[-1])
        weights = _served(s, policy)
        behind = (_served(s, run.store.localize(checkpoints[-2])) if len(checkpoints) > 1 and s.grpo.max_staleness
                  else prep.weights)
        log.info(f"run '{run.run_id}': iterations 0-{len(done) - 1} are done, continuing at iteration {len(done)}")
    reference = prep.policy if s.grpo.kl_coef else None
    with iteration_runner(s.scale_out, run.run_id) as runner:  # a Dask or Ray cluster outlives each iteration
        for n in range(len(done), s.pipeline.iterations):
            iterate = rl_iteration if runner is None else rl_iteration.with_options(task_runner=runner())
            it = iterate(s, n, policy, weights, reference, pending,
                         behind if s.grpo.max_staleness and n else None)
            behind, pending = weights, it.next_rollouts
            policy, weights = it.policy, it.weights
            history.append(it.metrics)
            done.append(it.lineage)
            log.info(reports.progress_line(n, s.pipeline.iterations, it.metrics))
            reports.record_lineage(s, prep.lineage(), done)
            reports.publish_iteration(s, history, _flat(prep, done))
            pruned = prune_checkpoints(s, latest=it.policy.version)  # after the records: resume never needs them
            if pruned:
                log.info(f"--keep-checkpoints {s.pipeline.keep_checkpoints}: deleted the checkpoints and trainer "
                         f"states of versions {', '.join(map(str, pruned))}")
            progress_event("iterations", done=n + 1, total=s.pipeline.iterations)
    final = evaluate(run, "final", weights, s.evaluation.prompts, s.rollout, s.reward, device=device)
    # a continued run's prepare found its work done; the seconds it really cost are the recorded ones
    prep_seconds = (reports.recorded_prepare_seconds(s) if done_before else None) or prep.seconds
    summary = reports.summary(s, prep_seconds, history, final, time.perf_counter() - t_start, prep.memory, device,
                              run.dtype)
    reports.publish_iteration(s, history, _flat(prep, done), final=summary)
    return summary


def _served(s: RLSettings, checkpoint: Artifact) -> Artifact:
    """A checkpoint as the weights the engine serves (experts quantised as the run's rollouts are)."""
    return dataclasses.replace(checkpoint, info={**checkpoint.info, "quantized": s.rollout.quantized})


def _flat(prep: Prepared, done: list[list[Artifact]]) -> list[Artifact]:
    return prep.lineage() + [a for it in done for a in it]
