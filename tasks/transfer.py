"""transfer_weights: push the trainer's new weights into the live rollout engine with their version
(``k3core.transfer.push_inprocess``, the in-process path); routed experts are re-quantised to MXFP4
on the way (sent packed, into the W4A8 engine's expert buffers) and the engine recomputes its
derived caches (AttnRes ``w * gamma``) before the next request. The result is an ``engine``
artifact: the content digest of the version over every tensor's digest, and the bytes, seconds and
GB/s of the transfer."""

from __future__ import annotations

import time

import torch

from k3core.artifacts import Artifact
from k3core.rl import engines, trainers
from tasks.common import Run, stage


def _blank_engine(config, dtype: torch.dtype, quantized: bool, device: torch.device | str = "cpu",
                  decode: str = "dynamic"):
    """An engine of ``config`` on ``device`` at version -1 with zero weights, decoding in ``decode``
    (a resolved mode), for the first transfer of a process (or after a rerun of an older iteration):
    every version then arrives through the same path."""
    from k3core.checkpoint.names import materialize, meta_model
    from k3core.rl.weights import engine_from_model

    model = materialize(meta_model(config), device).cast(dtype)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.zero_()
    return engine_from_model(model, -1, quantized, decode=decode)


def _takes(engine, quantized: bool) -> bool:
    """Whether ``engine``'s routed experts are in the format this transfer sends (a W4A8 engine takes
    packed MXFP4 experts, a float engine float ones)."""
    from k3core.rollout.quantized import expert_format

    fmt = expert_format(engine.model)
    return fmt == "none" or (fmt in ("w4a8", "w4a16")) == quantized


@stage(run_name="transfer_weights-iter{iteration}", key="transfer",
       outputs=lambda run, checkpoint, **_: [run.engine_uri(checkpoint.version)],
       inputs=lambda checkpoint, **_: [checkpoint.uri], cache_policy=None, persist_result=False)
def transfer_weights(run: Run, iteration: int, checkpoint: Artifact, quantized: bool,
                     in_flight: str = "drain") -> Artifact:
    """Not cached: the engine lives in this process, so every run pushes (an in-memory copy on the
    run's device: the trainer's tensors go straight into the engine's on the same device, routed experts
    quantised to MXFP4 there, no disk and no host round trip; the disk path,
    ``k3core.transfer.write_disk``, is for a separate rollout server, ``tasks.rollout.rollout_client``).
    ``in_flight``: what the update does to a rollout still generating on the engine (``--in-flight``)."""
    from k3core.transfer import push_inprocess

    t0 = time.perf_counter()
    model = trainers.weights(run.run_id, checkpoint, run.device, run.dtype)
    eng = engines.get(run.run_id)
    if (eng is None or eng.weight_version >= checkpoint.version or not _takes(eng, quantized)
            or eng.device.type != run.device or eng.decode_mode != run.decode):
        eng = _blank_engine(model.config, trainers.dtype_of(model), quantized, run.device, run.decode)
        engines.put(run.run_id, eng)
    rep = push_inprocess(eng, model.state_dict(), checkpoint.version, quantize_experts=quantized, in_flight=in_flight)
    return Artifact(kind="engine", uri=run.engine_uri(checkpoint.version), path=rep.path,
                    sha256=rep.content_sha256, version=checkpoint.version,
                    info={"bytes": rep.bytes_sent, "tensors": rep.tensors_sent, "seconds": time.perf_counter() - t0,
                          "transfer_seconds": rep.seconds, "gbps": rep.gbps, "hash": rep.hash, "quantized": quantized})
