"""In-process weight transfer: trainer tensors straight into a ``RolloutEngine`` in the same process.

Owns: ``push_inprocess``. Nothing is serialised and nothing travels: the engine's ``load_weights``
copies each tensor into its own storage (names and shapes checked there first, every derived cache
recomputed, the version published last). What this adds on top: the version check, routed experts
re-quantised to MXFP4 one tensor at a time, per-tensor digests (for the lineage record and an
optional read-back check), and dtype checks (``load_weights``' ``copy_`` would
otherwise cast silently, and a cast weight is not the trainer's weight).

Digests are computed in a second thread while the engine copies. Memory: plain tensors are passed by reference (no copy before the engine's own); quantised experts
exist once as their MXFP4 codes (W4A8 engine) or as their dequantised float values (``w4a8=False``)
until the engine has copied them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping

import torch

from k3core.transfer.digest import check_algo, default_algo, tensor_digest
from k3core.transfer.wire import TransferError, TransferReport, content_sha256, decode_item, dtype_name, item_digest, iter_wire

__all__ = ["push_inprocess", "engine_tensors"]


def engine_tensors(engine) -> dict[str, torch.Tensor]:
    """The engine's own parameters and persistent buffers by name (the tensors ``load_weights`` fills)."""
    return {k: v.data if isinstance(v, torch.nn.Parameter) else v for k, v in engine.model.state_dict(keep_vars=True).items()}


@torch.no_grad()
def push_inprocess(engine, named_tensors: Mapping[str, torch.Tensor], version: int, *, quantize_experts: bool = False,
                   w4a8: bool = True, algo: str | None = None, verify: bool = False,
                   refresh: bool = True, in_flight: str = "drain") -> TransferReport:
    """Load ``named_tensors`` (a native trainer state dict: every parameter and persistent buffer)
    into ``engine`` as ``version``.

    ``quantize_experts``/``w4a8``: see ``k3core.transfer.wire``. ``algo``: digest algorithm (default
    ``default_algo``); ``"none"`` skips digests (then no ``verify``). ``verify``: hash the engine's
    copies of the raw tensors after loading and compare. ``refresh=False`` is passed to
    ``load_weights`` (only to demonstrate the stale AttnRes cache), and ``in_flight`` (what the update
    does to sequences still generating: ``RolloutEngine.load_weights``). Raises ``TransferError`` (engine
    untouched) for a version not newer than the engine's, or a name, shape or dtype mismatch.
    """
    if version <= engine.weight_version:
        raise TransferError(f"weight version {version} is not newer than the engine's {engine.weight_version}: refused")
    first = next(iter(named_tensors.values()), None)
    algo = algo or default_algo(first.device if first is not None else "cpu")
    hashing = algo != "none"
    if hashing:
        check_algo(algo)
    elif verify:
        raise ValueError("verify needs digests: pass a digest algorithm, not 'none'")
    t0 = time.perf_counter()
    own = engine_tensors(engine)
    items = []
    for item in iter_wire(named_tensors, quantize_experts, w4a8):
        dst = own.get(item.name)
        if dst is not None and dst.dtype != item.dtype:
            raise TransferError(f"{item.name}: sent as {item.dtype}, the engine holds {dst.dtype}: refused "
                                f"(cast on the trainer side if that is meant)")
        items.append(item)

    def digest_all() -> list[str]:
        return [item_digest([tensor_digest(p, algo) for p in it.parts()]) for it in items]

    # the digests are of the trainer's tensors: computed in a second thread while the engine copies
    # (both only read them; hashing and copy_ release the GIL)
    pool = ThreadPoolExecutor(1, thread_name_prefix="k3-transfer-digest") if hashing else None
    pending = pool.submit(digest_all) if pool is not None else None
    digests = [""] * len(items)
    state = {item.name: decode_item(item) for item in items}
    try:
        engine.load_weights(state, version, refresh=refresh, in_flight=in_flight)
    except ValueError as e:  # load_weights refuses a name, shape or dtype mismatch before copying anything
        raise e if isinstance(e, TransferError) else TransferError(str(e)) from e
    finally:
        if pool is not None:
            digests = pending.result()
            pool.shutdown()
    rows = [(it.name, dtype_name(it.dtype), list(it.shape), it.codec, d) for it, d in zip(items, digests)]
    if verify:
        # after the fact, so it cannot protect this version: it catches a loader that changed bytes
        bad = [n for n, _, _, codec, d in rows if codec == "raw" and tensor_digest(own[n], algo) != d]
        if bad:
            raise TransferError(f"engine copies differ from what was sent after loading: {bad[:3]}")
    nbytes = sum(it.nbytes() for it in items)
    return TransferReport("inprocess", version, algo, content_sha256(rows, algo) if hashing else "", len(rows),
                          nbytes, time.perf_counter() - t0)
