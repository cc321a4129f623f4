"""Stage 7, transfer_weights: push the trainer's new weights into the live rollout engine with their
version (``k3core.transfer.push_inprocess``, the in-process path); routed experts are re-quantised to
MXFP4 on the way (sent packed, into the W4A8 engine's expert buffers) and the engine recomputes its
derived caches (AttnRes ``w * gamma``) before the next request. Reports the bytes moved, seconds,
GB/s, the content digest of the version (``sha256`` over every tensor's digest) and the path."""

from __future__ import annotations

import time

import torch

from tasks import engines


def _blank_engine(config, dtype: torch.dtype, quantized: bool):
    """An engine of ``config`` at version -1 with zero weights, for the first transfer of a process
    (or after a rerun of an older iteration): every version then arrives through the same path."""
    from k3core.checkpoint.names import materialize, meta_model
    from k3core.rl.stages import engine_from_model

    model = materialize(meta_model(config), "cpu").cast(dtype)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.zero_()
    return engine_from_model(model, -1, quantized)


def _takes(engine, quantized: bool) -> bool:
    """Whether ``engine``'s routed experts are in the format this transfer sends (a W4A8 engine takes
    packed MXFP4 experts, a float engine float ones)."""
    from k3core.rollout.quantized import expert_format

    fmt = expert_format(engine.model)
    return fmt == "none" or (fmt in ("w4a8", "w4a16")) == quantized


def transfer_weights(run_id: str, checkpoint: dict, quantized: bool) -> dict:
    from k3core.rl.stages import load_trainer_state
    from k3core.transfer import push_inprocess

    t0 = time.perf_counter()
    model, _, _ = load_trainer_state(checkpoint["path"], lr=0.0)
    eng = engines.get(run_id)
    if eng is None or eng.weight_version >= checkpoint["version"] or not _takes(eng, quantized):
        eng = _blank_engine(model.config, next(model.parameters()).dtype, quantized)
        engines.put(run_id, eng)
    rep = push_inprocess(eng, model.state_dict(), checkpoint["version"], quantize_experts=quantized)
    return {"version": checkpoint["version"], "path": rep.path, "bytes": rep.bytes_sent, "tensors": rep.tensors_sent,
            "seconds": time.perf_counter() - t0, "transfer_seconds": rep.seconds, "gbps": rep.gbps,
            "sha256": rep.content_sha256, "hash": rep.hash, "quantized": quantized}
