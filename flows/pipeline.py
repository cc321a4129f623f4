"""The RL pipeline as Prefect flows: ``prepare`` (fetch, validate, warm-up, quantize), ``rl_iteration``
(rollout, score, train, save, transfer) and ``rl_run`` (prepare + N iterations + reports).

Every stage is a task declared in ``tasks/`` (its retries, cache policy and lineage live there) that
publishes its artifacts atomically under ``<artifacts>/runs/<run_id>/`` and is cached on its inputs
and source, so re-running ``rl_run`` with the same run id resumes after the last finished stage:
nothing finished is recomputed, no rollout batch is lost. Stages hand each other ``Artifact``
handles. One iteration N (engine at weight version N):

    rollout(engine@N) -> rollouts.parquet -> score -> scored.parquet -> train_step(state N) -> state N+1
    (live) -> transfer_weights (MXFP4 experts) -> engine@N+1

Checkpoints off the critical path: state N+1 is written (``save_checkpoint``: the trainer state,
hashed as written, then the checkpoint and ``latest``) as a task of ``rl_run`` beside the whole of
iteration N+1, and joined after it, before the next save starts. Iteration N+1's first optimizer
step, which is what changes the state, freezes the write first: the writer copies what it has not
read yet and goes on (``k3core.rl.trainers.WriteBehind``). With ``--save-every K`` only every K-th
state (and the last) is written, so a write slower than an iteration still hides behind K of them. An iteration is recorded (``metrics.json``, ``lineage.json``)
once the state after it, or a later one, is durable; a resumed run re-runs the unrecorded
iterations from the last checkpoint, finding their published tables (never sampled again) and
repeating their train steps (bit-identical on the CPU).

With ``--refill-rounds`` (dynamic sampling), rollout and score run again on new prompts
(``rollouts-refill1.parquet``, ...) while too few groups carry signal, before the train step.

With ``--kl-coef`` > 0, ``reference_logprobs`` computes the frozen reference's (the run's starting
policy) log-probabilities of the batch (``ref-logprobs.parquet``) for the train step's KL penalty.

With ``--max-staleness K`` (K = 1: one-step-off-policy), iteration N's batch was sampled by version
max(0, N-K): iteration N submits the rollout of N+K on the engine at version N to the flow's task
runner, trains beside it, and joins it before the transfer moves the engine to N+1 (one engine serves
one version); the batches of iterations 1..K-1 are sampled in line by version 0. The batches sampled
ahead are published artifacts like any other, a buffer on disk: a resumed run finds them and trains
on them in order, never samples them again. The schedule of versions is fixed by N and K alone, so a
run is reproducible at every K. With ``--in-flight continue|abort`` the transfer does not wait for
the batch sampled ahead: the update reaches its sequences mid-generation (they go on with the new
weights, or are sampled again by them), each token records the version that sampled it, and the
batch is joined after the transfer. Which tokens the update reaches depends on timing, so such a
run is reproducible only from its published tables (a resume finds them).
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
from flows.trackers import open_trackers
from k3core.artifacts import Artifact
from k3core.rl import trainers
from k3core.settings import RLSettings
from tasks.common import Batch, Run, memory_metrics, progress_event, stage_memory, stage_timings
from tasks.evaluate import evaluate
from tasks.fetch import fetch_checkpoint
from tasks.mismatch import rollout_mismatch
from tasks.quantize import quantize_mxfp4
from tasks.reference import reference_logprobs
from tasks.rollout import rollout, rollout_client, rollout_fanout, rollout_fanout_submit
from tasks.save import save_checkpoint
from tasks.score import fans_out, score_fanout, score_rewards
from tasks.train import data_position, train_step
from tasks.transfer import transfer_weights
from tasks.validate import validate_checkpoint
from tasks.warmup import warmup

__all__ = ["Iteration", "Prepared", "RLSettings", "check_environment", "prepare", "refill", "rl_iteration", "rl_run",
           "sample_round"]


def check_environment(s: RLSettings) -> bool:
    """Load the run's environment before any stage runs (a bad spec raises ``ValueError`` naming it);
    return whether the warm-up runs: it needs ``reference(prompt)``, which the protocol makes
    optional, so an environment without it skips the warm-up with a notice."""
    from k3core.rl.envs import load_env

    env = load_env(s.pipeline.env)
    if s.warmup.runs() and not any(callable(getattr(env, m, None)) for m in ("reference", "reference_turns")):
        get_run_logger().warning(f"environment {s.pipeline.env!r} has no reference(prompt): skipping the supervised "
                                 "warm-up (RL starts from the fetched checkpoint; --warmup-steps 0 silences this)")
        return False
    return s.warmup.runs()


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
    policy: Artifact  # the trainer state after the update (version N+1), live in this process or durable
    weights: Artifact  # what the engine serves next (version N+1)
    metrics: dict
    lineage: list[Artifact]
    next_rollouts: Artifact | None = None  # the next iteration's batch, sampled ahead at this version
    saved: Artifact | None = None  # this iteration's checkpoint, when it was written here (no next iteration to hide it)
    unsaved: Artifact | None = None  # this iteration's state, to be written beside the next iteration


@flow(name="prepare", flow_run_name="{settings.pipeline.run_id}-prepare", log_prints=True)
def prepare(settings: RLSettings) -> Prepared:
    """fetch -> validate -> (supervised warm-up) -> quantize (MXFP4 rollout weights, version 0)."""
    s, run = settings, Run.of(settings)
    warm = check_environment(s)
    with stage_timings() as seconds, stage_memory() as peaks:
        checkpoint = fetch_checkpoint(run, s.model.source)
        report = validate_checkpoint(run, checkpoint, s.model.preset)
        policy = warmup(run, checkpoint, s.warmup) if warm else checkpoint
        weights = quantize_mxfp4(run, policy) if s.rollout.quantized else policy
    return Prepared(checkpoint, report, policy, weights, seconds, memory_metrics(peaks))


def save_due(s: RLSettings, iteration: int) -> bool:
    """Whether the trainer state after ``iteration`` is written: every ``--save-every`` iterations
    and after the last."""
    return (iteration + 1) % s.pipeline.save_every == 0 or iteration + 1 >= s.pipeline.iterations


def save_behind(s: RLSettings, iteration: int) -> bool:
    """Whether that save runs beside the next iteration's rollout instead of in this iteration: when
    there is a next iteration, and the trainer lives in this process (the local task runner and one
    train process; Dask or Ray workers and torchrun ranks read each state from disk)."""
    return (iteration + 1 < s.pipeline.iterations and s.scale_out.task_runner == "local"
            and s.scale_out.train_procs == 1)


@flow(name="rl_iteration", flow_run_name="{settings.pipeline.run_id}-iter{iteration}", log_prints=True,
      task_runner=ThreadPoolTaskRunner(max_workers=3))
def rl_iteration(settings: RLSettings, iteration: int, policy: Artifact, weights: Artifact,
                 reference: Artifact | None = None, rollouts: Artifact | None = None,
                 behind: Artifact | None = None) -> Iteration:
    """One iteration (the module's diagram). ``policy``: the trainer's weights at the version the
    engine serves (``weights``); ``reference``: the frozen policy of the KL penalty (``kl_coef`` > 0);
    ``rollouts``: this iteration's batch when an earlier iteration sampled it ahead, else sampled
    here by ``behind`` (``sampled_by``: the version ``max_staleness`` before this one) or, without
    it, by ``weights``. Under ``max_staleness`` K the batch of iteration N+K is sampled here, at this
    version: on this process's engine beside the stages up to the save (the one engine serves one
    version: the transfer waits for it), or on the workers' engines beside all of them."""
    s, run, t0 = settings, Run.of(settings), time.perf_counter()
    lag = s.grpo.max_staleness
    ahead = lag > 0 and iteration + lag < s.pipeline.iterations
    with stage_timings() as seconds, stage_memory() as peaks:
        heldout = (evaluate(run, f"iter{iteration}", weights, s.evaluation.prompts, s.rollout, s.reward)
                   if s.evaluation.due(iteration) else {})
        batch = sample_round(s, run, iteration, behind or weights, Batch(s.rollout, data_position(policy)), rollouts)
        batch = refill(s, run, iteration, weights, batch)
        if ahead:  # batch N+K, at this version, beside the stages up to the save (the engine made ready here),
            # or on the workers' engines, beside every stage up to the iteration's end; with K > 1 no refill
            # rounds (refused up front), so each batch after this one starts P prompts on
            cursor = batch.next_position + (lag - 1) * s.rollout.prompts_per_iteration
            pending = ahead_round(s, run, iteration + lag, weights, cursor)
        mismatch = (rollout_mismatch(run, iteration, policy, batch.rollouts[0], s.evaluation.mismatch_sequences,
                                     s.rollout.temperature)
                    if s.rollout.quantized and s.evaluation.mismatch_due(iteration) else {})
        ref = reference_logprobs(run, iteration, reference, batch, s.grpo) if s.grpo.kl_coef else None
        trained = train_step(run, iteration, policy, batch, s.grpo, ref, s.scale_out.train_procs)
        # a resumed run's state may be on disk already: only its commit is left, done here
        later = save_due(s, iteration) and save_behind(s, iteration) and trainers.unwritten(trained)
        saved = save_checkpoint(run, iteration, trained) if save_due(s, iteration) and not later else None
        in_flight = s.rollout.in_flight if ahead else "drain"  # continue|abort: the update reaches batch N+K
        if ahead and in_flight == "drain" and not fanned_out(s):
            pending.result()  # this process's engine keeps this version until the batch ahead is done (or raises)
        engine = transfer_weights(run, iteration, trained, s.rollout.quantized, in_flight)
        next_rollouts = pending.result() if ahead else None
    metrics = reports.iteration_metrics(iteration, batch, trained, engine, heldout, mismatch, seconds)
    metrics.update(seconds_iteration=time.perf_counter() - t0, device=run.device, dtype=run.dtype,
                   **memory_metrics(peaks))
    lineage = [*batch.artifacts(), *([ref] if ref is not None else []), trained, engine]
    return Iteration(trained, _served(s, trained), metrics, lineage, next_rollouts, saved,
                     trained if later else None)


def sample_round(s: RLSettings, run: Run, iteration: int, weights: Artifact, batch: Batch,
                 rollouts: Artifact | None = None) -> Batch:
    """``batch`` with its next sampling round (round 0, or dynamic-sampling refill round r), rolled
    out on ``weights`` and scored; ``rollouts``: the round's table when it was sampled ahead (only
    scored here). The one place that decides where: in this process, or fanned out over the task
    runner's workers (``--task-runner dask|ray``: rollout shards on resident engines, and a sandboxed
    environment's reward calls); the same tables either way."""
    r, fan, workers = batch.rounds, fanned_out(s), s.scale_out.rollout_workers
    if rollouts is None:
        rollouts = (rollout_fanout(run, iteration, weights, s.rollout, workers, r, batch.cursor) if fan
                    else rollout(run, iteration, weights, s.rollout, r, batch.cursor))
    scored = (score_fanout(run, iteration, rollouts, s.grpo, s.reward, workers, r) if fan and fans_out(run)
              else score_rewards(run, iteration, rollouts, s.grpo, s.reward, r))
    return batch.plus(rollouts, scored)


def fanned_out(s: RLSettings) -> bool:
    """Rollouts run as shards on the task runner's workers (``--task-runner dask|ray``)."""
    return s.scale_out.task_runner != "local"


def ahead_round(s: RLSettings, run: Run, iteration: int, weights: Artifact, cursor: int):
    """Submit batch ``iteration`` (round 0 from data position ``cursor``) on ``weights``, to run beside
    the stages that follow; its ``result()`` is the rollout table. On this process's engine (which
    then keeps this version until the batch is done, unless ``--in-flight`` lets an update reach it),
    or as shards on the workers' resident engines, each of which loads this version for them: nothing
    in this process waits for those."""
    if fanned_out(s):
        return rollout_fanout_submit(run, iteration, weights, s.rollout, s.scale_out.rollout_workers, cursor=cursor,
                                     ahead=True)
    rollout_client(run, weights, s.rollout.url)
    return rollout.submit(run, iteration, weights, s.rollout, cursor=cursor, in_flight=s.rollout.in_flight != "drain")


def refill(s: RLSettings, run: Run, iteration: int, weights: Artifact, batch: Batch) -> Batch:
    """Dynamic sampling: while fewer than ``prompts_per_iteration`` groups of ``batch`` have rewards
    that differ, one more round of new prompts on the same weights, at most ``refill_rounds``."""
    while batch.informative < s.rollout.prompts_per_iteration and batch.rounds <= s.grpo.refill_rounds:
        batch = sample_round(s, run, iteration, weights, batch)
    return batch


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
    s = settings
    run = Run.of(s)  # --device cuda without a GPU fails here, before any stage
    recorded = reports.finished_summary(s)
    if recorded is not None:  # nothing to do: no stage, transfer or evaluation runs, no record is rewritten
        log.info(f"run '{run.run_id}' finished its {recorded['iterations']} iterations already: nothing to do "
                 f"(its records are under {run.rel()}/; a larger --iterations continues it)")
        return recorded
    t_start = time.perf_counter()
    log.info(f"run '{run.run_id}': stages compute on {run.device} (--device {s.device.type})")
    progress_event("iterations", done=0, total=s.pipeline.iterations)
    prep = prepare(s)
    history, done = reports.finished_iterations(s)  # a continued run starts after its last recorded iteration
    done_before = len(done)
    progress_event("iterations", done=len(done), total=s.pipeline.iterations)
    policy, weights = prep.policy, prep.weights
    # --max-staleness K: the batches sampled ahead, by iteration; the weights of each version, which
    # sample a batch that no earlier iteration sampled ahead (``sampled_by``): served by this process,
    # or on record (a resumed run's checkpoints, localized when one is used)
    pending: dict[int, Artifact] = {}
    served, recorded = {0: prep.weights}, {}
    if done:
        # the recorded handles name the local paths of the machine that made them; on another machine,
        # or after its cache was emptied, the checkpoints read here are downloaded from the root again
        # (with --save-every K only every K-th iteration has one; the last recorded always does)
        checkpoints = [a for it in done for a in it if a.kind == "dcp" and "manifest" in a.info]
        policy = run.store.localize(checkpoints[-1])
        weights = _served(s, policy)
        recorded = {c.version: c for c in checkpoints}
        log.info(f"run '{run.run_id}': iterations 0-{len(done) - 1} are done, continuing at iteration {len(done)}")
    reference = prep.policy if s.grpo.kl_coef else None
    t_loop = time.perf_counter()
    unsaved, unrecorded = None, []  # a state written beside the next iteration; iterations not durable yet
    trackers = open_trackers(s)  # TensorBoard / MLflow, when asked
    with trackers, iteration_runner(s.scale_out, run.run_id) as runner:  # a Dask or Ray cluster outlives each iteration
        for n in range(len(done), s.pipeline.iterations):
            saving = write_behind(run, n - 1, unsaved) if unsaved is not None else None
            iterate = rl_iteration if runner is None else rl_iteration.with_options(task_runner=runner())
            ahead = pending.pop(n, None)
            behind = None if ahead is not None else sampled_by(s, run, n, served, recorded)
            it = iterate(s, n, policy, weights, reference, ahead, behind)
            if it.next_rollouts is not None:
                pending[n + s.grpo.max_staleness] = it.next_rollouts
            it.metrics["buffer_depth"] = len(pending)  # batches sampled ahead, published, not yet trained on
            unsaved, policy, weights = it.unsaved, it.policy, it.weights
            served[n + 1] = weights
            unrecorded.append((it.metrics, it.lineage))
            for saved in (joined(saving, it.metrics), it.saved):  # durable up to its version: record up to it
                if saved is not None:
                    unrecorded = _record(s, prep, history, done, unrecorded, saved)
            trackers.log(history)  # the iterations just recorded
            pace = (time.perf_counter() - t_loop) / (n + 1 - done_before)  # seconds per iteration so far
            log.info(reports.progress_line(n, s.pipeline.iterations, it.metrics, pace * (s.pipeline.iterations - n - 1)))
            progress_event("iterations", done=n + 1, total=s.pipeline.iterations)
    final = evaluate(run, "final", weights, s.evaluation.prompts, s.rollout, s.reward)
    # a continued run's prepare found its work done; the seconds it really cost are the recorded ones
    prep_seconds = (reports.recorded_prepare_seconds(s) if done_before else None) or prep.seconds
    summary = reports.summary(s, prep_seconds, history, final, time.perf_counter() - t_start, prep.memory, run.device,
                              run.dtype)
    reports.publish_iteration(s, history, _flat(prep, done), final=summary)
    trackers.log(history)
    trackers.log_summary(summary, step=len(history))
    trackers.close()
    return summary


def sampled_by(s: RLSettings, run: Run, iteration: int, served: dict[int, Artifact],
               recorded: dict[int, Artifact]) -> Artifact | None:
    """The weights that sample ``iteration``'s batch when no earlier iteration sampled it ahead
    (iterations before the K-th, or a resumed run's first K): version max(0, N - K) under
    ``max_staleness`` K, None when synchronous (the iteration's own weights). A resumed run knows the
    versions on record only: the oldest at or after that one (``--save-every`` writes every S-th
    state), so the lag stays within K. A batch published before the kill is found, not sampled again,
    whatever these weights are."""
    lag = s.grpo.max_staleness
    if not lag or not iteration:
        return None
    want = max(0, iteration - lag)
    version = min(v for v in {*served, *recorded} if v >= want)
    if version in served:
        return served[version]
    return _served(s, run.store.localize(recorded[version]))


def write_behind(run: Run, iteration: int, unsaved: Artifact):
    """Submit the save of ``unsaved`` (the state after ``iteration``, live in this process) to run
    beside the next iteration; that iteration's first optimizer step releases it first."""
    saving = save_checkpoint.submit(run, iteration, unsaved)
    trainers.write_behind(run.run_id, unsaved.version, saving.result, lambda: saving.future.state.is_final())
    return saving


def joined(saving, metrics: dict) -> Artifact | None:
    """The checkpoint of a save submitted by ``write_behind``, once it is durable (None without one).
    The iteration it ran beside gets ``seconds_save_wait`` (how long the flow still waited for it
    after the iteration's stages, also added to ``seconds_iteration``) and ``seconds_save_ahead`` (its
    whole time, from submission)."""
    if saving is None:
        return None
    with stage_timings() as seconds:
        saved = saving.result()
    metrics.update({f"seconds_{k}": v for k, v in seconds.items()})
    metrics["seconds_iteration"] = metrics.get("seconds_iteration", 0.0) + seconds.get("save_wait", 0.0)
    return saved


def _record(s: RLSettings, prep: Prepared, history: list[dict], done: list[list[Artifact]],
            unrecorded: list[tuple[dict, list[Artifact]]], checkpoint: Artifact) -> list[tuple[dict, list[Artifact]]]:
    """Record the iterations up to ``checkpoint``'s version (now durable): their metrics and lineage,
    the checkpoint in the lineage of the iteration that trained it; then prune older checkpoints.
    Returns the iterations still unrecorded. An iteration is on record only once a resume can start
    after it: a resumed run re-runs the unrecorded ones (their published tables found, not sampled
    again; their train steps repeated from the last checkpoint)."""
    k = checkpoint.version - len(done)
    for metrics, lineage in unrecorded[:k]:
        history.append(metrics)
        done.append(lineage)
    done[-1] = [*done[-1], checkpoint]
    reports.record_lineage(s, prep.lineage(), done)
    reports.publish_iteration(s, history, _flat(prep, done))
    pruned = prune_checkpoints(s, latest=checkpoint.version)  # after the records: resume never needs them
    if pruned:
        get_run_logger().info(f"--keep-checkpoints {s.pipeline.keep_checkpoints}: deleted the checkpoints and "
                              f"trainer states of versions {', '.join(map(str, pruned))}")
    return unrecorded[k:]


def _served(s: RLSettings, checkpoint: Artifact) -> Artifact:
    """A checkpoint as the weights the engine serves (experts quantised as the run's rollouts are)."""
    return dataclasses.replace(checkpoint, info={**checkpoint.info, "quantized": s.rollout.quantized})


def _flat(prep: Prepared, done: list[list[Artifact]]) -> list[Artifact]:
    return prep.lineage() + [a for it in done for a in it]
