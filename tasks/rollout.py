"""rollout: sample completions at a given weight version through ``RolloutClient``: the embedded
engine (``url="local"``, the default) or a rollout server at a URL (``k3rl rollout-server``, or SGLang
serving K3); per-token logprobs, routed expert ids and the weight version, written as Parquet. A
server that does not serve the version asked for is first pushed those weights from disk; a rollout
whose rows carry another version is refused, never written.

Fan-out (``--task-runner dask|ray``, ``rollout_fanout``): the prompts are cut into ``--rollout-workers``
contiguous shards (``k3core.rl.shards``), each shard is a ``rollout_shard`` task submitted to the
flow's task runner (a Dask worker with its resident engine, or a Ray task that runs the shard on an
engine actor), and ``rollout_merge`` publishes their rows in the one-engine order: the same table
whatever the number of shards, with the worker of each row recorded. A worker that dies mid-shard
loses only that shard: Dask runs the task again on another worker, on Ray the task hands the shard
to the next actor; a finished shard is a published file that a rerun skips."""

from __future__ import annotations

import hashlib
from collections import Counter

import pyarrow.parquet as pq
from prefect import get_run_logger

from k3core.artifacts import Artifact
from k3core.rl import engines, resident, trainers
from k3core.settings import RolloutSettings
from tasks.common import Run, round_run_name, stage


def engine_for(run: Run, weights: Artifact, newer: bool = False):
    """The live engine at ``weights.version`` (``newer``: or at a later one) on the run's device, in
    its decode mode, with its non-expert weights in the run's dtype, or a new one there built from the
    durable artifact. Quantised weights run on the W4A8 engine (MXFP4 routed experts, FP8 activations)."""
    from k3core.device import torch_dtype
    from k3core.rl.weights import build_engine, engine_from_model

    eng = engines.get(run.run_id)
    if (eng is not None and (eng.weight_version == weights.version or newer and eng.weight_version > weights.version)
            and eng.device.type == run.device and eng.decode_mode == run.decode):
        return eng
    if weights.kind == "dcp":  # a trainer checkpoint: quantise routed experts on the way
        import copy

        model = copy.deepcopy(trainers.weights(run.run_id, weights, run.device, run.dtype))  # the engine takes it over
        eng = engine_from_model(model, weights.version, quantized=weights.info.get("quantized", True),
                                decode=run.decode)
    else:
        eng = build_engine(weights.path, weights.version, torch_dtype(run.dtype), device=run.device,
                           decode=run.decode)
    engines.put(run.run_id, eng)
    return eng


def release_decode_state(run_id: str) -> int:
    """Free the live embedded engine's decode state once a stage has its completions (the train step
    that follows shares the device); the engine keeps its weights. Returns the bytes released."""
    eng = engines.get(run_id)
    if eng is None or eng.is_serving:
        return 0
    try:
        return eng.release_decode_state()
    except RuntimeError:  # a batch is running (a rollout sampled ahead): the stage running it releases it
        return 0


def rollout_client(run: Run, weights: Artifact, url: str = "local", newer: bool = False):
    """A ``RolloutClient`` serving ``weights.version``: the live embedded engine (``engine_for``), or
    the server at ``url``, pushed the weights through ``/update_weights_from_disk`` when it serves
    another version (a trainer checkpoint is first written in the public layout,
    ``k3core.transfer.write_disk``). The one-step-off-policy flow calls it before it submits the next
    rollout, so that rollout finds its engine ready and never reads the trainer's live model, which
    the train step running beside it changes in place. ``newer``: the embedded engine may serve a
    later version already (``--in-flight continue|abort``: a rollout sampled ahead that the weight
    update reached before it began samples on the update's weights, never on older ones)."""
    from k3core.rollout.client import RolloutClient

    if url in (None, "", "local"):
        return RolloutClient("local", engine=engine_for(run, weights, newer))

    config = run.model_config(weights)
    client = RolloutClient(url, config=config)
    if str(client.weight_version()) == str(weights.version):
        return client
    if weights.kind != "dcp":  # already a public-layout checkpoint
        client.update_weights_from_disk(weights.path, weights.version)
        return client
    import shutil
    import tempfile

    from k3core.transfer import write_disk

    model = trainers.weights(run.run_id, weights, run.device, run.dtype)
    tmp = tempfile.mkdtemp(prefix="k3rl-push-")
    try:
        write_disk(f"{tmp}/weights", model, model.config, weights.version, weights.info.get("quantized", True))
        client.update_weights_from_disk(f"{tmp}/weights", weights.version)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return client


def _rel(run: Run, iteration: int, refill: int = 0) -> str:
    return run.iter_rel(iteration, f"rollouts-refill{refill}.parquet" if refill else "rollouts.parquet")


def _seed(run: Run, iteration: int, refill: int) -> int:
    if not refill:
        return run.seed * 100003 + iteration
    return int(hashlib.sha256(f"{run.seed}:{iteration}:refill{refill}".encode()).hexdigest()[:8], 16)


def _prompts(run: Run, iteration: int, settings: RolloutSettings, refill: int, cursor: int) -> list[str]:
    """The prompts of round ``refill`` of an iteration whose data position starts at ``cursor``
    (a dataset environment reads them at ``cursor + refill * prompts_per_iteration``)."""
    from k3core.rl.data import training_prompts
    from k3core.rl.envs import load_env

    n = settings.prompts_per_iteration
    return training_prompts(load_env(run.env), run.seed, iteration, n, run.env, refill=refill,
                            position=cursor + refill * n)


def _sampling(run: Run, iteration: int, refill: int, settings: RolloutSettings, stop_ids: tuple[int, ...]):
    from k3core.rollout.engine import SamplingParams

    return SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                          top_p=settings.top_p, stop_token_ids=stop_ids, n=settings.samples_per_prompt,
                          seed=_seed(run, iteration, refill))


def _token_versions(table) -> list[int]:
    """The weight version of every sampled token of a rollout table (environment-written ones have none)."""
    return [v for row in table.column("token_versions").to_pylist() for v in (row or ()) if v is not None]


def _handle(run: Run, iteration: int, refill: int, settings: RolloutSettings, path, **info) -> Artifact:
    """The rollout table's handle: its rows, tokens, the weight version its rows were sampled with (a
    batch published earlier, sampled ahead by the previous version in one-step-off-policy mode and
    then resumed in another mode, keeps its own) and the group size the scores normalise over. A
    batch a weight update reached mid-generation (``--in-flight``) has the oldest version of its
    tokens as its version, and ``newer_tokens``: how many of its sampled tokens a later one sampled."""
    table = pq.read_table(path, columns=["output_ids", "weight_version", "token_versions"])
    tokens = sum(len(x) for x in table.column("output_ids").to_pylist())
    sampled = _token_versions(table)
    version = min(sampled or set(table.column("weight_version").to_pylist()))
    newer = sum(v > version for v in sampled)
    if newer:
        info = {**info, "newer_tokens": newer, "newest_version": max(sampled)}
    if sampled:  # [version, tokens it sampled] pairs (JSON keeps no int keys)
        info = {**info, "tokens_by_version": sorted(map(list, Counter(sampled).items()))}
    where = (f"{info['shards']} shards on workers {', '.join(info['workers'])}" if "shards" in info
             else f"engine {settings.url}")
    mixed = f" ({newer} of them sampled by version {max(sampled)}: a weight update in flight)" if newer else ""
    get_run_logger().info(f"iteration {iteration}{f' refill {refill}' if refill else ''}: {table.num_rows} samples, "
                          f"{tokens} tokens, weight version {version}{mixed}, {where}")
    return run.store.handle(_rel(run, iteration, refill), "rollouts", version=version, rows=table.num_rows,
                            tokens=tokens, group_size=settings.samples_per_prompt, **info)


@stage(run_name=round_run_name("rollout"),
       outputs=lambda run, iteration, refill, **_: [run.uri(_rel(run, iteration, refill))],
       inputs=lambda run, weights, **_: [run.served_uri(weights)])
def rollout(run: Run, iteration: int, weights: Artifact, settings: RolloutSettings, refill: int = 0,
            cursor: int = 0, in_flight: bool = False) -> Artifact:
    """``settings.prompts_per_iteration`` prompts x ``samples_per_prompt`` completions on the run's
    device. ``refill`` > 0: a dynamic-sampling round of new prompts for the same iteration and
    weights, in a file of its own (task run ``rollout-iterN-refillR``), its prompts numbered after
    the earlier rounds'. ``cursor``: the data position at the start of the iteration (``Batch.cursor``).
    ``in_flight``: the batch sampled ahead under ``--in-flight continue|abort``, which a weight update
    may reach mid-generation (or before it starts): its tokens come from ``weights.version`` or later,
    each recording its own. The embedded engine's decode state is released once the batch is written."""
    from k3core.rl.episodes import EpisodeLimits
    from k3core.rl.tables import rollout_table
    from k3core.rollout.client import WeightVersionMismatch

    def build(tmp):
        client = rollout_client(run, weights, settings.url, in_flight)
        if not in_flight:
            client.check_version(weights.version)
        fmt = run.prompts(run.model_config(weights), weights.path)
        prompts = _prompts(run, iteration, settings, refill, cursor)
        params = _sampling(run, iteration, refill, settings, fmt.stop_ids)
        # the client has generate()'s signature
        table = rollout_table(client, fmt, prompts, params, iteration,
                              first_prompt_index=refill * settings.prompts_per_iteration,
                              episode_limits=EpisodeLimits.of(settings), env_spec=run.env)
        versions = set(_token_versions(table)) | set(table.column("weight_version").to_pylist())
        if (min(versions) < weights.version) if in_flight else versions != {weights.version}:
            raise WeightVersionMismatch(f"rollout {iteration} came back with weight versions {sorted(versions)}, "
                                        f"expected {weights.version} " + ("or later (--in-flight)" if in_flight else
                                                                          "only (the weights changed mid-rollout)"))
        pq.write_table(table, tmp)

    path = run.store.publish_once(_rel(run, iteration, refill), build)
    release_decode_state(run.run_id)
    return _handle(run, iteration, refill, settings, path)


# ---- fan-out over resident engine workers ----------------------------------------------------------------

def _shards_rel(run: Run, iteration: int, refill: int, shard: tuple[int, int]) -> str:
    folder = f"rollout-shards-refill{refill}" if refill else "rollout-shards"
    return run.iter_rel(iteration, f"{folder}/shard-{shard[0]}-of-{shard[1]}.parquet")


@stage(run_name=lambda iteration, shard, **_: f"rollout-iter{iteration}-shard{shard[0]}-of-{shard[1]}",
       outputs=lambda run, iteration, refill, shard, **_: [run.uri(_shards_rel(run, iteration, refill, shard))],
       inputs=lambda run, weights, **_: [run.served_uri(weights)])
def rollout_shard(run: Run, iteration: int, weights: Artifact, settings: RolloutSettings, prompts: tuple[str, ...],
                  shard: tuple[int, int], refill: int = 0) -> Artifact:
    """Shard ``shard`` = (k, n), the k-th of n, of the rollout of ``prompts`` (all of the rollout's
    prompts; the shard generates its contiguous run of them) on a resident engine at
    ``weights.version``: this Dask worker's, or on Ray the run's engine actor k (another when that one
    dies, ``k3core.rl.resident.actor_rows``). An agentic environment's shard runs whole episodes
    there, its tools in that worker's sandbox."""
    from k3core.rl.shards import ShardRequest, shard_bounds

    rel = _shards_rel(run, iteration, refill, shard)
    bounds = shard_bounds(len(prompts), shard[1])[shard[0]]
    made_by = {}

    def build(tmp):
        from k3core.rl.episodes import EpisodeLimits, is_agentic

        fmt = run.prompts(run.model_config(weights), weights.path)
        agentic = is_agentic(fmt.env)
        req = ShardRequest(run.run_id, str(weights.path), weights.kind, weights.version,
                           weights.info.get("quantized", True), tuple(prompts), bounds,
                           _sampling(run, iteration, refill, settings, fmt.stop_ids), iteration, refill * len(prompts),
                           run.dtype, None if agentic else tuple(tuple(fmt.prompt_ids(p)) for p in prompts),
                           run.tokenizer_dir(weights.path), fmt.chat, run.env if agentic else None,
                           EpisodeLimits.of(settings) if agentic else None)
        table, made_by["worker"] = resident.shard_rows(req, *shard, warn=get_run_logger().warning)
        pq.write_table(table, tmp)

    path = run.store.publish_once(rel, build)
    rows = pq.read_metadata(path).num_rows
    worker = made_by.get("worker") or _worker_of(path)
    return run.store.handle(rel, "rollout-shard", version=weights.version, rows=rows, worker=worker,
                            prompts=list(bounds))


def _worker_of(path) -> str:
    """The worker recorded in a published shard's rows (a shard a rerun found finished)."""
    workers = set(pq.read_table(path, columns=["worker"]).column("worker").to_pylist())
    return ",".join(sorted(workers)) or "none"


@stage(run_name="rollout-iter{iteration}-merge", key="rollout_merge",
       outputs=lambda run, iteration, refill, **_: [run.uri(_rel(run, iteration, refill))],
       inputs=lambda shards, **_: [a.uri for a in shards])
def rollout_merge(run: Run, iteration: int, weights: Artifact, settings: RolloutSettings,
                  shards: tuple[Artifact, ...], refill: int = 0) -> Artifact:
    """The shards' rows as one rollout table (``k3core.rl.shards.merge_shards``), published where the
    one-engine rollout publishes it."""
    from k3core.rl.shards import merge_shards

    n = settings.prompts_per_iteration

    def build(tmp):
        table = merge_shards([pq.read_table(a.path) for a in shards], n, settings.samples_per_prompt, refill * n)
        pq.write_table(table, tmp)

    path = run.store.publish_once(_rel(run, iteration, refill), build)
    workers = sorted(set(pq.read_table(path, columns=["worker"]).column("worker").to_pylist()))
    return _handle(run, iteration, refill, settings, path, shards=len(shards), workers=workers)


class FannedOut:
    """Rollout shards submitted to the flow's task runner (``rollout_fanout_submit``), running on the
    workers' resident engines while the flow goes on; ``result()`` waits for them and merges them.
    Call both from one flow body: the shards' futures belong to that flow run's task runner."""

    def __init__(self, run: Run, iteration: int, weights: Artifact, settings: RolloutSettings, futures: list,
                 refill: int, submitted: float, seconds: float, ahead: bool):
        self.run, self.iteration, self.weights, self.settings = run, iteration, weights, settings
        self.futures, self.refill, self.submitted, self.seconds, self.ahead = futures, refill, submitted, seconds, ahead

    def result(self) -> Artifact:
        """The merged rollout table. The enclosing stage timings get ``rollout``: the flow's seconds in
        it (submitting, then waiting here); or for a batch sampled ahead (it ran beside other stages),
        as a submitted stage's do, ``rollout_ahead`` (submission to its last shard's end) and
        ``rollout_wait`` (how long the flow still waited here). The merge times itself."""
        import time

        from tasks.common import record_seconds

        t0 = time.perf_counter()
        parts = tuple(f.result() for f in self.futures)
        t1 = time.perf_counter()
        if self.ahead:
            record_seconds("rollout_wait", t1 - t0)
            record_seconds("rollout_ahead", max((f.done_at or t1) for f in self.futures) - self.submitted)
        else:
            record_seconds("rollout", self.seconds + t1 - t0)
        return rollout_merge(self.run, self.iteration, self.weights, self.settings, parts, self.refill)


def rollout_fanout_submit(run: Run, iteration: int, weights: Artifact, settings: RolloutSettings, shards: int,
                          refill: int = 0, cursor: int = 0, ahead: bool = False) -> FannedOut:
    """The rollout of ``rollout`` (the same prompts: ``refill`` and ``cursor`` as there) as ``shards``
    ``rollout_shard`` tasks submitted to the flow's task runner; nothing waits for them here. Each
    shard carries ``weights`` (path and version), which its worker's engine loads when it serves
    another version, so shards of two versions may be in flight at once (``--max-staleness``;
    ``ahead``: a batch sampled ahead, timed as one)."""
    import time

    from k3core.rl.envs import load_env
    from k3core.rl.harness import is_harness

    if is_harness(load_env(run.env)):
        raise ValueError(f"environment {run.env!r} runs an agent harness against one rollout server, which rollout "
                         "shards on Dask or Ray workers do not: use --task-runner local (with --rollout-url for a "
                         "server of your own)")
    t0 = time.perf_counter()
    prompts = tuple(_prompts(run, iteration, settings, refill, cursor))
    futures = [rollout_shard.submit(run, iteration, weights, settings, prompts, (k, shards), refill)
               for k in range(shards)]
    return FannedOut(run, iteration, weights, settings, futures, refill, t0, time.perf_counter() - t0, ahead)


def rollout_fanout(run: Run, iteration: int, weights: Artifact, settings: RolloutSettings, shards: int,
                   refill: int = 0, cursor: int = 0) -> Artifact:
    """``rollout_fanout_submit``, waited for and merged (``rollout_merge``). Call it from a flow body."""
    return rollout_fanout_submit(run, iteration, weights, settings, shards, refill, cursor).result()
