"""Stage 7, transfer_weights: push the trainer's new weights into the live rollout engine with their
version; routed experts are re-quantised to MXFP4 on the way (sent packed, into the W4A8 engine's
expert buffers) and the engine recomputes its derived caches (AttnRes ``w * gamma``) before the next request."""

from __future__ import annotations

import hashlib
import time

import torch

from tasks import engines


def transfer_weights(run_id: str, checkpoint: dict, quantized: bool) -> dict:
    from k3core.rl.stages import engine_matches, engine_state, load_trainer_state

    t0 = time.perf_counter()
    model, _, _ = load_trainer_state(checkpoint["path"], lr=0.0)
    sd = engine_state(model, quantize_experts=quantized)
    h = hashlib.sha256()
    nbytes = 0
    for k in sorted(sd):
        t = sd[k].contiguous()
        nbytes += t.numel() * t.element_size()
        h.update(k.encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    eng = engines.get(run_id)
    if eng is None or not engine_matches(eng, quantized):  # W4A8 when quantized: it takes the packed state
        from k3core.rl.stages import engine_from_model

        eng = engine_from_model(model, checkpoint["version"], quantized)
        engines.put(run_id, eng)
    eng.load_weights(sd, checkpoint["version"])
    return {"version": checkpoint["version"], "bytes": nbytes, "seconds": time.perf_counter() - t0,
            "sha256": h.hexdigest(), "quantized": quantized}
