"""reference_logprobs: the frozen reference policy's log-probability of every generated token of an
iteration's batch (the scored table and any refill rounds'), for the KL penalty of the train step
(``GRPOSettings.kl_coef``). The reference is a public-layout checkpoint that never changes during
the run (the pipeline passes its starting policy: the warmed-up weights, or the fetched checkpoint);
it is read once per process and kept, keyed by its content hash. Output: ``iter-N/ref-logprobs.parquet``
(``REF_LOGPROBS_SCHEMA``: prompt_index, sample_index, ref_logprobs), published atomically."""

from __future__ import annotations

import threading

from prefect import get_run_logger

from k3core.artifacts import Artifact
from k3core.settings import GRPOSettings
from tasks.common import Batch, Run, read_table, stage

_lock = threading.Lock()
_models: dict[str, object] = {}  # reference sha256 -> model (frozen; read only)


def reference_model(run: Run, reference: Artifact):
    """The reference policy of ``reference`` on the run's device in its dtype (read once per process,
    device and dtype; the caller must not change it)."""
    if reference.kind == "dcp":
        raise ValueError(f"the KL reference {reference.uri} is a trainer state: give a public-layout checkpoint "
                         "(the run's warmed-up or fetched weights)")
    with _lock:
        key = f"{reference.sha256}@{run.device}:{run.dtype}"
        model = _models.get(key)
        if model is None:
            from k3core.device import torch_dtype
            from k3core.rl.weights import load_policy

            _models.clear()  # one reference per process at a time
            model = load_policy(reference.path, torch_dtype(run.dtype), device=run.device).requires_grad_(False)
            _models[key] = model
        return model


def _rel(run: Run, iteration: int) -> str:
    return run.iter_rel(iteration, "ref-logprobs.parquet")


@stage(run_name="reference_logprobs-iter{iteration}", key="reference",
       outputs=lambda run, iteration, **_: [run.uri(_rel(run, iteration))],
       inputs=lambda reference, batch, **_: [reference.uri, *(a.uri for a in batch.scored)])
def reference_logprobs(run: Run, iteration: int, reference: Artifact, batch: Batch,
                       settings: GRPOSettings) -> Artifact:
    """``batch``: the iteration's scored rounds (first round, then refills); their rows are keyed by
    (prompt_index, sample_index), distinct across rounds. The log-probabilities are the trainer's
    computation on the reference's weights on the run's device (``reference_logprobs_table``: the
    rollouts' temperature, ``settings.micro_batch_tokens``, routing replay as
    ``settings.routing_replay``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from k3core.rl.train import reference_logprobs_table

    rel = _rel(run, iteration)

    def build(tmp):
        model = reference_model(run, reference)
        table = pa.concat_tables([read_table(a) for a in batch.scored])
        out = reference_logprobs_table(model, table, settings, model.config.pad_token_id,
                                       temperature=batch.sampling.temperature)
        pq.write_table(out, tmp)

    path = run.store.publish_once(rel, build)
    rows = pq.read_metadata(path).num_rows
    get_run_logger().info(f"iteration {iteration}: reference logprobs of {rows} rollouts from {reference.uri}")
    return run.store.handle(rel, "ref-logprobs", version=reference.version, rows=rows)
