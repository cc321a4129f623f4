"""In-process weight transfer: trainer tensors straight into a ``RolloutEngine`` in the same process.

Owns: ``push_inprocess``. Nothing is serialised and nothing travels: the engine's ``load_weights``
copies each tensor into its own storage (names and shapes checked there first, every derived cache
recomputed, the version published last). What this adds on top: the version check, routed experts
re-quantised to MXFP4 one tensor at a time, per-tensor digests (for the lineage record, delta
transfers and an optional read-back check), and dtype checks (``load_weights``' ``copy_`` would
otherwise cast silently, and a cast weight is not the trainer's weight).

Memory: plain tensors are passed by reference (no copy before the engine's own); quantised experts
exist once as their MXFP4 codes (W4A8 engine) or as their dequantised float values (``w4a8=False``)
until the engine has copied them.
"""

from __future__ import annotations

import time
from typing import Mapping

import torch

from k3core.transfer.delta import DeltaTracker
from k3core.transfer.digest import check_algo, default_algo, tensor_digest
from k3core.transfer.wire import TransferError, TransferReport, content_sha256, decode_item, dtype_name, item_digest, iter_wire

__all__ = ["push_inprocess", "engine_tensors"]


def engine_tensors(engine) -> dict[str, torch.Tensor]:
    """The engine's own parameters and persistent buffers by name (the tensors ``load_weights`` fills)."""
    m = engine.model
    own = dict(m.named_parameters()) | {k: v for k, v in m.named_buffers() if v is not None}
    persistent = set(m.state_dict().keys())
    return {k: v for k, v in own.items() if k in persistent}


@torch.no_grad()
def push_inprocess(engine, named_tensors: Mapping[str, torch.Tensor], version: int, *, quantize_experts: bool = False,
                   w4a8: bool = True, algo: str | None = None, tracker: DeltaTracker | None = None,
                   verify: bool = False, refresh: bool = True) -> TransferReport:
    """Load ``named_tensors`` (a native trainer state dict: every parameter and persistent buffer)
    into ``engine`` as ``version``.

    ``quantize_experts``/``w4a8``: see ``k3core.transfer.wire``. ``algo``: digest algorithm (default
    ``default_algo``); ``"none"`` skips digests (then no ``tracker`` and no ``verify``). ``tracker``:
    delta transfer: tensors whose digest equals the tracker's record of the engine's current version
    are not copied (the engine keeps its own). ``verify``: hash the engine's copies of the raw tensors
    after loading, and of the unchanged tensors before, and compare. ``refresh=False`` is passed to
    ``load_weights`` (only to demonstrate the stale AttnRes cache). Raises ``TransferError`` (engine
    untouched) for a version not newer than the engine's, or a name, shape or dtype mismatch.
    """
    if version <= engine.weight_version:
        raise TransferError(f"weight version {version} is not newer than the engine's {engine.weight_version}: refused")
    first = next(iter(named_tensors.values()), None)
    algo = algo or default_algo(first.device if first is not None else "cpu")
    hashing = algo != "none"
    if hashing:
        check_algo(algo)
    elif tracker is not None or verify:
        raise ValueError("delta transfer and verify need digests: pass a digest algorithm, not 'none'")
    t0 = time.perf_counter()
    own = engine_tensors(engine)
    base_version, base = tracker.base(algo) if tracker is not None else (None, {})
    if base_version != engine.weight_version:  # the engine moved on by another path: send everything
        base_version, base = None, {}
    state: dict[str, torch.Tensor] = {}
    digests: dict[str, str] = {}
    rows = []
    sent = sent_bytes = total_bytes = 0
    for item in iter_wire(named_tensors, quantize_experts, w4a8):
        dst = own.get(item.name)
        if dst is not None and dst.dtype != item.dtype:
            raise TransferError(f"{item.name}: sent as {item.dtype}, the engine holds {dst.dtype}: refused "
                                f"(cast on the trainer side if that is meant)")
        d = item_digest([tensor_digest(p, algo) for p in item.parts()]) if hashing else ""
        digests[item.name] = d
        rows.append((item.name, dtype_name(item.dtype), list(item.shape), item.codec, d))
        total_bytes += item.nbytes()
        if base and dst is not None and base.get(item.name) == d:
            if verify and item.codec == "raw" and tensor_digest(dst, algo) != d:
                raise TransferError(f"{item.name}: the engine's copy does not match the digest of version "
                                    f"{base_version} it should hold: delta refused")
            state[item.name] = dst  # copy_ onto itself is skipped by torch
            continue
        state[item.name] = decode_item(item)
        sent += 1
        sent_bytes += item.nbytes()
    try:
        engine.load_weights(state, version, refresh=refresh)
    except TransferError:
        raise
    except ValueError as e:  # load_weights refuses a name or shape mismatch before copying anything
        raise TransferError(str(e)) from e
    if verify:
        # after the fact, so it cannot protect this version: it catches a loader that changed bytes
        bad = [n for n, _, _, codec, d in rows if codec == "raw" and tensor_digest(own[n], algo) != d]
        if bad:
            raise TransferError(f"engine copies differ from what was sent after loading: {bad[:3]}")
    if tracker is not None:
        tracker.commit(version, digests, algo)
    return TransferReport("inprocess", version, algo, content_sha256(rows, algo) if hashing else "", len(rows), sent,
                          total_bytes, sent_bytes, time.perf_counter() - t0, base_version=base_version)
