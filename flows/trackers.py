"""The run's per-iteration metrics in the trackers users run beside Prefect: TensorBoard event files
and an MLflow run, each when asked (``--tensorboard DIR``, ``--mlflow-uri URI``), off by default.

Owns: ``open_trackers`` (what ``rl_run`` holds for the run) and ``Trackers.log`` (every row of
``metrics.json`` not yet logged, one step per iteration: step ``i`` is iteration ``i``, with the
same numbers; non-numeric fields are left out), the final held-out figures at step ``iterations``
(``log_summary``). Does not own: the metrics themselves (``flows/reports.py``), the trackers' own
storage and UI.

What holds on a resumed or continued run:
- Only recorded iterations are logged (a row goes to the trackers after ``metrics.json`` has it),
  so a killed process never leaves points of an iteration its resume will run again.
- TensorBoard: each process opens its writer with ``purge_step=0`` and writes every recorded row
  again: TensorBoard drops the earlier processes' events of the run, so one curve, no doubled
  points, and no row lost where a process died between recording an iteration and logging it.
- MLflow: one MLflow run per k3rl run, found again by its tag ``k3rl.run_id`` in the experiment
  (``--mlflow-experiment``, default ``k3rl``); steps it already holds are not logged again. The
  run's settings are its params, logged when it is created.

A tracker that cannot be used (package missing, tracking store unreachable) is named before any
work (``check_trackers``, called by ``flows/preflight.py``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

__all__ = ["Trackers", "open_trackers", "check_trackers", "numbers"]

RUN_TAG = "k3rl.run_id"


def numbers(row: dict) -> dict[str, float]:
    """The finite numeric fields of a metrics row (bools and non-numbers left out)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def check_trackers(s) -> None:
    """A tracker asked for whose package is missing, or whose MLflow store cannot be opened:
    ``ValueError`` naming the flag and the fix (the CLI's exit 2), before any work."""
    p = s.pipeline
    if p.tensorboard:
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise ValueError(f"--tensorboard {p.tensorboard}: writing TensorBoard event files needs tensorboardX; "
                             "pip install 'k3rl[trackers]' (or drop --tensorboard)") from None
    if p.mlflow_uri:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise ValueError(f"--mlflow-uri {p.mlflow_uri}: logging to MLflow needs mlflow; "
                             "pip install 'k3rl[trackers]' (or drop --mlflow-uri)") from None
        _mlflow_run(s, create=False)


def _mlflow_run(s, create: bool):
    """(client, MLflow run id or None) of this k3rl run in its experiment; with ``create``, made
    when missing (the settings as params)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    p = s.pipeline
    try:
        client = MlflowClient(tracking_uri=p.mlflow_uri)
        exp = client.get_experiment_by_name(p.mlflow_experiment)
        if exp is None:
            if not create:
                return client, None
            exp_id = client.create_experiment(p.mlflow_experiment)
        else:
            exp_id = exp.experiment_id
        found = client.search_runs([exp_id], f"tags.`{RUN_TAG}` = '{p.run_id}'", max_results=1)
        if found:
            return client, found[0].info.run_id
        if not create:
            return client, None
        run = client.create_run(exp_id, run_name=p.run_id, tags={RUN_TAG: p.run_id})
        params = {f"{sec}.{k}": str(v)[:500] for sec, fields in s.to_dict().items() for k, v in fields.items()}
        items = list(params.items())
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            from mlflow.entities import Param

            client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in items[i:i + 100]])
        return client, run.info.run_id
    except MlflowException as e:
        raise ValueError(f"--mlflow-uri {p.mlflow_uri}: the MLflow tracking store cannot be used ({e}); give a "
                         "reachable server (http://127.0.0.1:5000) or a database (sqlite:///path/mlflow.db)") from None


class Trackers:
    """The trackers of one run (none when neither flag is given: ``log`` does nothing)."""

    def __init__(self, s):
        self.tb = self.mlflow = None
        self.tb_logged = self.mlflow_logged = 0  # rows of metrics.json each holds
        if s.pipeline.tensorboard:
            from tensorboardX import SummaryWriter

            logdir = Path(s.pipeline.tensorboard) / s.pipeline.run_id
            self.tb = SummaryWriter(logdir=str(logdir), purge_step=0)
        if s.pipeline.mlflow_uri:
            self.mlflow, self.mlflow_run = _mlflow_run(s, create=True)
            held = self.mlflow.get_metric_history(self.mlflow_run, "iteration")
            self.mlflow_logged = max((int(m.step) + 1 for m in held), default=0)

    def log(self, history: list[dict]) -> None:
        """Every row of ``history`` (``metrics.json``) a tracker does not hold yet, step = its position."""
        rows = {step: numbers({**history[step], "iteration": step}) for step in range(len(history))}
        if self.tb is not None:
            for step in range(self.tb_logged, len(history)):
                self._tensorboard(step, rows[step])
            self.tb_logged = max(self.tb_logged, len(history))
        if self.mlflow is not None:
            for step in range(self.mlflow_logged, len(history)):
                self._mlflow(step, rows[step])
            self.mlflow_logged = max(self.mlflow_logged, len(history))

    def log_summary(self, summary: dict, step: int) -> None:
        """The run's final held-out figures (``summary.json``'s numbers, as ``final/<name>``) at
        ``step`` (= iterations)."""
        values = {f"final/{k}": v for k, v in numbers(summary).items()}
        if self.tb is not None:
            self._tensorboard(step, values)
        if self.mlflow is not None:
            self._mlflow(step, values)

    def _tensorboard(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.tb.add_scalar(k, v, global_step=step)
        self.tb.flush()

    def _mlflow(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.mlflow.log_batch(self.mlflow_run, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        """The run finished: its event file closed, its MLflow run marked FINISHED."""
        self._close_writer()
        if self.mlflow is not None:
            self.mlflow.set_terminated(self.mlflow_run)

    def _close_writer(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:  # a failed or stopped run: its MLflow run stays RUNNING until a resume finishes it
            self._close_writer()


def _mlflow_key(k: str) -> str:
    """MLflow metric names allow letters, digits, ``_ - . / space``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in k)


def open_trackers(s) -> Trackers:
    """The run's trackers (``log`` does nothing when neither flag is given)."""
    return Trackers(s)
