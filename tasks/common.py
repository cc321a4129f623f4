"""What every stage shares: retries with backoff, resume-friendly caching, asset lineage, naming.

- Retries: 2 with exponential backoff, except for errors retrying cannot fix (bad input, validation
  failures, an environment returning NaN, a full disk): those fail at once with their message.
- Caching: ``INPUTS + TASK_SOURCE`` with results persisted as JSON under
  ``<artifact root>/.prefect-results`` (not keyed on the flow run id), so a re-run of a run id skips
  every finished stage; a record there that is not k3rl's JSON is never read (``tasks/results.py``).
- Lineage: each stage runs as a Prefect ``MaterializingTask`` whose assets are the URIs it publishes
  and whose ``asset_deps`` are the URIs it read, so the Event Feed records checkpoint -> weights ->
  rollouts -> scores -> checkpoint. The ``Artifact`` a stage returns is stamped with the same facts
  (``produced_by``, ``inputs``) for the run's lineage report.
- Declaration: ``@stage(...)`` on the stage body, in its own module, says all of the above once (task
  run name, published and read URIs as functions of the arguments, extra Prefect options); the flow
  then calls the stage like a function, or ``.submit(...)``s it to run beside what the flow does next
  (the flow's task runner; ``.result()`` joins it). ``stage_timings()`` collects each call's wall time,
  ``stage_memory()`` its peak device memory and host RSS (``k3core.device.MemoryProbe``, on the
  run's device, ``Run.device``; a submitted stage is not probed, its memory shows in
  the peaks of the stages it runs beside).
- Fault injection (tests only, ``K3RL_FAULT``, ``k3core/faults.py``): with it set, each stage body
  runs inside ``faults.in_stage`` so its publishes know their stage, and may kill the process after
  the body returned, before Prefect records the task run; unset, the body is the task's function.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from prefect import Task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from prefect.tasks import MaterializingTask, exponential_backoff

from k3core import faults
from k3core.artifacts import Artifact, ArtifactStore
from k3core.checkpoint.validate import CheckpointValidationError
from k3core.rl.layout import RunLayout
from k3core.settings import DECODE_MODES, DTYPES, RLSettings, RolloutSettings, SettingsError

if TYPE_CHECKING:
    from k3core.rl.prompting import PromptFormat

NON_RETRYABLE = (ValueError, TypeError, KeyError, NotImplementedError, FileNotFoundError, PermissionError,
                 CheckpointValidationError, SettingsError)
RETRIES = int(os.environ.get("K3RL_TASK_RETRIES", "2"))


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry transient failures only. Storage errors (``StorageError``,
    after botocore's and s3fs's own retries) are retried unless they are access denied or missing
    credentials (a ``PermissionError``) or a missing object or bucket (a ``FileNotFoundError``). A
    full disk (``ENOSPC``, ``EDQUOT``) is not retried either: the space must be freed first."""
    from k3core.rl.disk import disk_full_error

    try:
        state.result()
    except NON_RETRYABLE:
        return False
    except Exception as e:
        return disk_full_error(e) is None
    return True


def stage_options(result_root: str) -> dict[str, Any]:
    from tasks.results import StageResultSerializer, TrustedCache

    return dict(
        retries=RETRIES,
        retry_delay_seconds=exponential_backoff(backoff_factor=1),
        retry_jitter_factor=0.5,
        retry_condition_fn=retry_unless_bad_input,
        cache_policy=TrustedCache(inner=INPUTS + TASK_SOURCE, root=result_root),
        persist_result=True,
        result_serializer=StageResultSerializer(),
        result_storage=Path(result_root),
    )


def result_root_for(artifact_root: str) -> str:
    """Where Prefect persists stage results (JSON, ``tasks/results.py``): beside a local artifact root,
    in this machine's cache of a remote one."""
    store = ArtifactStore(artifact_root)
    p = Path(store.base if store.is_local else store.cache) / ".prefect-results"
    p.mkdir(parents=True, exist_ok=True)
    return str(p)


def _resolved(choices: tuple[str, ...]) -> tuple[str, ...]:
    """A setting's choices without "auto", which only a device resolves."""
    return tuple(c for c in choices if c != "auto")


@dataclass(frozen=True)
class Run:
    """A run's identity: where its artifacts live, its id, its environment and its seed, fixed for
    its whole life; and where and how it computes, resolved once per invocation from the settings
    (``Run.of``): the device, the dtype its models compute in (``--dtype auto`` follows the device,
    which a deployment's ticks may change: trainer states read in either dtype) and the embedded
    engine's decode mode. Every stage takes it first, so Prefect's input cache keys every stage on
    the device, dtype and decode mode it computed with. The artifact layout under ``runs/<run_id>/``
    is ``k3core.rl.layout.RunLayout``, which ``layout`` gives."""

    artifacts: str
    run_id: str
    env: str = "reverse"
    seed: int = 0
    device: str = "cpu"  # "cpu" or "cuda": where every stage computes (``k3core.device.run_device``)
    dtype: str = "float32"  # the trainer's and the engine's weights (``k3core.device.compute_dtype``)
    decode: str = "dynamic"  # the embedded engine's decode mode, resolved (``k3core.device.decode_mode``)
    prompt_format: str = "auto"  # chat, raw or auto (``k3core.rl.prompting``; auto follows the tokenizer)

    def __post_init__(self):
        resolved = (("device", self.device, ("cpu", "cuda")), ("dtype", self.dtype, _resolved(DTYPES)),
                    ("decode", self.decode, _resolved(DECODE_MODES)))
        problems = [f"{name} {value!r} is not resolved (one of {', '.join(allowed)}; Run.of resolves the settings)"
                    for name, value, allowed in resolved if value not in allowed]
        if problems:
            raise ValueError(f"Run {self.run_id!r}: " + "; ".join(problems))

    @classmethod
    def of(cls, s: RLSettings) -> Run:
        """The run ``s`` describes, its device, dtype and decode mode resolved here, once
        (``k3core.device``): ``--device cuda`` on a machine without one raises ``DeviceUnavailable``
        (a ``ValueError``) before any stage runs, and so does ``--decode graph`` where the run
        computes on the CPU."""
        from k3core.device import compute_dtype, decode_mode, run_device

        device = run_device(s).type
        return cls(s.pipeline.artifacts, s.pipeline.run_id, s.pipeline.env, s.pipeline.seed, device,
                   compute_dtype(device, s.device.dtype), decode_mode(device, s.rollout.decode),
                   s.pipeline.prompt_format)

    @property
    def store(self) -> ArtifactStore:
        return ArtifactStore(self.artifacts)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_id)

    def rel(self, *parts: str) -> str:
        return self.layout.rel(*parts)

    def iter_rel(self, iteration: int, name: str) -> str:
        return self.layout.iter_rel(iteration, name)

    def checkpoint_rel(self, version: int) -> str:
        return self.layout.checkpoint_rel(version)

    def uri(self, rel: str) -> str:
        return self.store.uri(rel)

    def tokenizer_dir(self, weights: str | os.PathLike) -> str:
        """Where this run's tokenizer is read: the files ``fetch_checkpoint`` published beside the
        source (``RunLayout.tokenizer``); for a stage called outside a run that fetched its checkpoint,
        the tokenizer of ``weights`` (a checkpoint directory)."""
        fetched = self.store.exists(self.layout.tokenizer)
        return str(self.store.open_local(self.layout.tokenizer) if fetched else weights)

    def model_config(self, weights: Artifact):
        """The ``K3Config`` of ``weights``: its ``config.json``; for a trainer state that is live in
        this process and not written yet, the run's (``fetch_checkpoint`` published the source's
        beside its tokenizer; training changes weights, never the architecture)."""
        from k3core.config import K3Config

        from k3core.rl.trainers import unwritten

        own = Path(weights.path, "config.json")
        if own.is_file() or not unwritten(weights):
            return K3Config.from_json_file(own)
        return K3Config.from_json_file(Path(self.store.open_local(self.layout.tokenizer), "config.json"))

    def prompts(self, config, weights: str | os.PathLike) -> PromptFormat:
        """How this run writes prompts and reads completions: its tokenizer (``tokenizer_dir``, read as
        data, never executed) for a model of ``config``, its environment, its ``--prompt-format``."""
        from k3core.rl.envs import load_env
        from k3core.rl.prompting import PromptFormat
        from k3core.tokenizer import load_tokenizer

        tok = load_tokenizer(self.tokenizer_dir(weights), config)
        return PromptFormat.of(tok, load_env(self.env), self.prompt_format)

    def engine_uri(self, version: int) -> str:
        """The weights live in this run's rollout engine at ``version`` (an asset the transfer stage
        materializes and rollouts read)."""
        return f"engine://{self.run_id}@v{version}"

    def served_uri(self, weights: Artifact) -> str:
        """What a rollout at ``weights`` samples from: the engine weights a transfer pushed (a trainer
        checkpoint, ``dcp``), or the published rollout weights of version 0, which the engine loads."""
        return self.engine_uri(weights.version) if weights.kind == "dcp" else weights.uri


@dataclass(frozen=True)
class Batch:
    """An iteration's training batch: its sampling rounds (the first, then the dynamic-sampling
    refills, in order) as rollout and scored tables, the settings they were sampled with, and the
    data position the first round's prompts start at (``tasks.train.data_position`` of the trainer
    state). Round ``r`` reads its prompts at ``cursor + r * prompts_per_iteration``."""

    sampling: RolloutSettings
    cursor: int = 0
    rollouts: tuple[Artifact, ...] = ()
    scored: tuple[Artifact, ...] = ()

    @property
    def rounds(self) -> int:
        return len(self.scored)

    @property
    def informative(self) -> int:
        """Groups whose rewards differ, over every round: what dynamic sampling counts."""
        return sum(sc.info["groups_informative"] for sc in self.scored)

    @property
    def next_position(self) -> int:
        """Where the next iteration's prompts start: past every round's prompts, trained on or not.
        The one place the data cursor advances (the train step records it in the trainer state; a
        rollout sampled ahead reads its prompts there)."""
        return self.cursor + self.sampling.prompts_per_iteration * self.rounds

    def plus(self, rollouts: Artifact, scored: Artifact) -> Batch:
        """The batch with one more round."""
        return dataclasses.replace(self, rollouts=(*self.rollouts, rollouts), scored=(*self.scored, scored))

    def artifacts(self) -> list[Artifact]:
        """Each round's rollouts then its scored table, round by round (the iteration's lineage)."""
        return [a for pair in zip(self.rollouts, self.scored) for a in pair]


_timings: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("k3rl_stage_timings", default=None)
_memory: contextvars.ContextVar[dict | None] = contextvars.ContextVar("k3rl_stage_memory", default=None)


@contextlib.contextmanager
def stage_timings():
    """Collect ``{stage key: seconds}`` of every stage called inside the block (cache hits included:
    a resumed stage costs what its lookup cost)."""
    seconds: dict[str, float] = {}
    token = _timings.set(seconds)
    try:
        yield seconds
    finally:
        _timings.reset(token)


@contextlib.contextmanager
def stage_memory():
    """Collect ``{stage key: StagePeak}`` of every stage called inside the block (two calls of one
    stage, such as refill rounds, keep the larger peaks). ``memory_metrics`` flattens it."""
    peaks: dict = {}
    token = _memory.set(peaks)
    try:
        yield peaks
    finally:
        _memory.reset(token)


def memory_metrics(peaks: dict, prefix: str = "") -> dict[str, int | str]:
    """``{stage: StagePeak}`` as flat metrics: ``memory_<prefix><stage>_device_peak_bytes``,
    ``..._device_bytes_after``, ``..._host_rss_peak_bytes``, and ``memory_host_rss_method``."""
    out: dict[str, int | str] = {}
    for key, p in peaks.items():
        out[f"memory_{prefix}{key}_device_peak_bytes"] = p.device_peak_bytes
        out[f"memory_{prefix}{key}_device_bytes_after"] = p.device_bytes_after
        out[f"memory_{prefix}{key}_host_rss_peak_bytes"] = p.host_rss_peak_bytes
        out["memory_host_rss_method"] = p.host_rss_method
    return out


def record_seconds(key: str, seconds: float) -> None:
    """Add ``seconds`` under ``key`` to the enclosing ``stage_timings()`` (work that is not one stage
    call, such as a fan-out of submitted stages)."""
    timings = _timings.get()
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + seconds


# Listeners of progress events, e.g. the progress bar of ``k3rl run`` (``flows/console.py``); one list per
# process, not a context variable: Prefect runs flows and tasks in threads of its own.
_progress_listeners: list[Callable[[str, dict], None]] = []


def add_progress_listener(fn: Callable[[str, dict], None]) -> None:
    _progress_listeners.append(fn)


def remove_progress_listener(fn: Callable[[str, dict], None]) -> None:
    if fn in _progress_listeners:
        _progress_listeners.remove(fn)


def progress_event(kind: str, **info: Any) -> None:
    """Tell the listeners what the run is doing: ``stage_start``/``stage_end`` (``name``: the task run
    name), ``stage_step`` (``name``, ``done``, ``total``: steps inside a long stage), ``iterations``
    (``done``, ``total``). A display is never a reason for a stage to fail: a listener that raises is
    dropped and logged."""
    for fn in list(_progress_listeners):
        try:
            fn(kind, info)
        except Exception as e:
            remove_progress_listener(fn)
            logging.getLogger("k3rl").warning(f"progress display stopped: {type(e).__name__}: {e}")


class Stage:
    """A stage body with its Prefect declaration; calling it runs the body as a task in the current
    flow (or standalone). ``.fn`` is the bare body (tests call it without Prefect)."""

    def __init__(self, fn: Callable, *, run_name: str | Callable[..., str], key: str, outputs: Callable[..., list[str]] | None,
                 inputs: Callable[..., list[str]] | None, options: dict[str, Any]):
        self.fn, self.run_name, self.key = fn, run_name, key
        self.outputs, self.inputs, self.options = outputs, inputs, options
        self.signature = inspect.signature(fn)
        functools.update_wrapper(self, fn)

    def task(self, *args: Any, **kwargs: Any) -> tuple[Task, str, list[str]]:
        """The Prefect task for one call: (task, task run name, input URIs)."""
        a = self._arguments(*args, **kwargs)
        run: Run = a["run"]
        outputs = list(self.outputs(**a)) if self.outputs else []
        inputs = [u for u in (self.inputs(**a) if self.inputs else []) if u]
        name = self.run_name(**a) if callable(self.run_name) else self.run_name.format(**a)
        opts = stage_options(result_root_for(run.artifacts))
        opts.update(self.options)
        fn = self.fn if faults.SPEC is None else _fault_points(self.fn, name, self.key)
        fn = _stamped(fn, name, tuple(inputs))
        task = MaterializingTask(fn=fn, name=self.fn.__name__, task_run_name=name, assets=outputs,
                                 asset_deps=inputs or None, **opts)
        return task, name, inputs

    def _arguments(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def run_of(self, *args: Any, **kwargs: Any) -> Run:
        """The ``Run`` a call names (its first parameter)."""
        return self.signature.bind(*args, **kwargs).arguments["run"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task, name, inputs = self.task(*args, **kwargs)
        run = self.run_of(*args, **kwargs)
        peaks = _memory.get()
        probe = None
        if peaks is not None:
            from k3core.device import MemoryProbe

            probe = MemoryProbe(run.device)
        t0 = time.perf_counter()
        progress_event("stage_start", name=name)
        try:
            with probe if probe is not None else contextlib.nullcontext():
                state = task(*args, return_state=True, **kwargs)
        finally:
            progress_event("stage_end", name=name)
        out = state.result()  # raises the stage's own exception when it failed
        seconds = _timings.get()
        if seconds is not None:
            seconds[self.key] = seconds.get(self.key, 0.0) + time.perf_counter() - t0
        if probe is not None:
            peaks[self.key] = peaks[self.key].merged(probe.peak) if self.key in peaks else probe.peak
        if isinstance(out, Artifact):
            out = _producer(_localized(run, out), name, tuple(inputs), state.state_details.task_run_id)
        return out

    def submit(self, *args: Any, **kwargs: Any) -> StageFuture:
        """Run the stage as a task on the current flow's task runner (threads, or a Dask worker with
        ``DaskTaskRunner``), concurrently with the flow's next calls (same retries, cache and lineage
        as a call). Join it with ``.result()``."""
        task, name, inputs = self.task(*args, **kwargs)
        return StageFuture(task.submit(*args, **kwargs), name, tuple(inputs), self.key, time.perf_counter(),
                           self.run_of(*args, **kwargs))


def _stamped(fn: Callable, name: str, inputs: tuple[str, ...]) -> Callable:
    """``fn`` whose returned ``Artifact`` names the task run that made it (``produced_by_id``) inside
    the result Prefect persists. A cache hit then returns the producer's id, not the id of the task run
    that found the result: the lineage links to the run that made each artifact, and a later stage's
    input (this handle) is the same on every tick, so its cache key is too and it is a cache hit (no
    new materialization event) instead of a body that runs again to find its published work.
    ``functools.wraps`` keeps the source the ``TASK_SOURCE`` cache key hashes."""

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if isinstance(out, Artifact):
            from prefect.context import TaskRunContext

            ctx = TaskRunContext.get()
            out = dataclasses.replace(out, produced_by=name, inputs=inputs,
                                      produced_by_id=str(ctx.task_run.id) if ctx is not None else "")
        return out

    return body


def _producer(out: Artifact, name: str, inputs: tuple[str, ...], task_run_id) -> Artifact:
    """The stage's handle with its lineage: the producer's task run id as recorded in the result (a
    cache hit keeps the run that made it), else this task run's."""
    run_id = out.produced_by_id or (str(task_run_id) if task_run_id else "")
    return dataclasses.replace(out, produced_by=name, inputs=inputs, produced_by_id=run_id)


def _fault_points(fn: Callable, name: str, key: str) -> Callable:
    """``fn`` with the fault points of ``k3core.faults`` around it. ``functools.wraps`` keeps what
    Prefect reads off the function (name, signature, and through ``__wrapped__`` the source that the
    ``TASK_SOURCE`` cache key hashes), so a run with fault injection and its resume without share
    their cache."""

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        with faults.in_stage(name, key):
            out = fn(*args, **kwargs)
            faults.reached("after-publish")
        return out

    return body


class StageFuture:
    """A submitted stage. ``result()`` waits for it and returns what a call would have returned; the
    timings of the enclosing ``stage_timings()`` block get ``<key>_ahead`` (its wall time from
    submission to completion, spent beside other stages) and ``<key>_wait`` (how long the flow then
    still waited for it: the part the overlap did not hide)."""

    def __init__(self, future: Any, name: str, inputs: tuple[str, ...], key: str, submitted: float, run: Run):
        self.future, self.name, self.inputs, self.key, self.run = future, name, inputs, key, run
        self._done_at: float | None = None
        self._submitted = submitted
        self._timed = False
        future.add_done_callback(self._mark_done)

    def _mark_done(self, _future: Any) -> None:
        self._done_at = time.perf_counter()

    @property
    def done_at(self) -> float | None:
        """``time.perf_counter()`` when the stage ended, None while it runs."""
        return self._done_at

    def result(self) -> Any:
        """The stage's result (waits for it; a later call returns at once and is not timed again)."""
        t0 = time.perf_counter()
        out = self.future.result()
        t1 = time.perf_counter()
        seconds = _timings.get()
        first, self._timed = not self._timed, True
        if seconds is not None and first:
            seconds[f"{self.key}_wait"] = seconds.get(f"{self.key}_wait", 0.0) + t1 - t0
            seconds[f"{self.key}_ahead"] = seconds.get(f"{self.key}_ahead", 0.0) + (self._done_at or t1) - self._submitted
        if isinstance(out, Artifact):
            out = _producer(_localized(self.run, out), self.name, self.inputs, getattr(self.future, "task_run_id", None))
        return out


class ChangedArtifact(ValueError):
    """A published file whose bytes are not the ones its handle recorded when it was published."""


def read_table(table: Artifact, columns: list[str] | None = None):
    """The parquet table of ``table``, after its file's sha256 is checked against the one recorded
    when it was published (a resumed run takes that handle from Prefect's record): a table edited,
    rewritten or bit-flipped since is refused (``ChangedArtifact``, naming the file), never trained
    or scored on."""
    import pyarrow.parquet as pq

    from k3core.artifacts import sha256_file

    got = sha256_file(table.path)
    if table.sha256 and got != table.sha256:
        raise ChangedArtifact(f"{table.uri} changed since it was published (sha256 {got[:12]}..., recorded "
                              f"{table.sha256[:12]}...): k3rl never rewrites a published table, so it was edited "
                              "or corrupted; restore it from a copy, or start the run again under a new --run-id")
    return pq.read_table(table.path, columns=columns)


def _localized(run: Run, out: Artifact) -> Artifact:
    """``out`` readable on this machine (``ArtifactStore.localize``); a trainer state that is live in
    this process and not written yet has nothing to download, and stays as it is."""
    from k3core.rl.trainers import unwritten

    return out if unwritten(out) else run.store.localize(out)


def round_run_name(stage_name: str) -> Callable[..., str]:
    """The task run name of a stage of one sampling round (``refill`` argument): ``<stage>-iterN``,
    and ``<stage>-iterN-refillR`` for dynamic-sampling round R."""
    return lambda iteration, refill=0, **_: f"{stage_name}-iter{iteration}" + (f"-refill{refill}" if refill else "")


def stage(*, run_name: str | Callable[..., str], key: str | None = None, outputs: Callable[..., list[str]] | None = None,
          inputs: Callable[..., list[str]] | None = None, **options: Any) -> Callable[[Callable], Stage]:
    """Declare a stage. ``run_name``: the task run name, a format string of the call's arguments
    (``"save_checkpoint-iter{iteration}"``) or a function of them (keyword), for a name that depends
    on an argument's value (a refill round's suffix); ``key``: its name in the per-iteration timings (default: the
    function name); ``outputs``/``inputs``: the URIs it publishes / reads, as functions of the call's
    arguments (keyword); ``options``: Prefect task options over ``stage_options``."""

    def wrap(fn: Callable) -> Stage:
        return Stage(fn, run_name=run_name, key=key or fn.__name__, outputs=outputs, inputs=inputs, options=options)

    return wrap
