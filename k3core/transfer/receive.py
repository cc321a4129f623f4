"""The one receiving entry of the cross-process transfer: a payload of either transport -> verified state.

Owns: ``receive(payload)`` and ``load_payload(engine, payload)`` (receive with the engine's version,
names, shapes and dtypes as the reference, then ``engine.load_weights``: what the server's
``/update_weights_from_tensor`` calls). Each reads the payload's ``transport`` and hands it to that
transport's receiver: ``"shm_stream"`` (``stream.py``, the shared-memory ring; the tensors come back
as staged host copies) or ``"cuda_ipc"`` (``cuda_ipc.py``; the tensors come back as views of the
sender's GPU buckets). Both apply the same checks (``verify.py``) before anything is returned or
loaded, so a refused transfer never reaches the engine and the previous version keeps serving:
the payload's structure; a version newer than ``current_version``; every part's bounds and digest;
every entry's dtype, shape and codec rules; the names, shapes and dtypes against ``expected``; the
content digest over all of it. Any failure raises ``TransferError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from k3core.transfer import cuda_ipc, stream
from k3core.transfer.inprocess import engine_tensors
from k3core.transfer.verify import need
from k3core.transfer.wire import FORMAT, TransferError

__all__ = ["receive", "load_payload", "TRANSPORTS"]

TRANSPORTS = (stream.TRANSPORT, cuda_ipc.TRANSPORT)


def receive(payload: dict, *, current_version: int | None = None,
            expected: Mapping[str, torch.Tensor | tuple] | None = None,
            apply: Callable[[dict[str, torch.Tensor], int], None] | None = None,
            staging: dict | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """Verify a transfer payload of either transport and return (state dict, weight version).

    ``current_version``: the receiver's version; the payload's must be newer. ``expected``: name ->
    tensor (or (shape, dtype)) the result must match exactly (the engine's own tensors). ``apply(state,
    version)``: run once everything is verified (for a stream, before the sender hears the outcome,
    so its ``wait()`` reports the load too); a ``ValueError`` from it refuses the transfer.
    ``staging``: a streamed transfer's staged tensors, kept by the caller across transfers
    (``receive_stream``); unused for CUDA IPC. Raises ``TransferError``.
    """
    need(isinstance(payload, dict), f"malformed payload: expected a JSON object, got {type(payload).__name__}")
    need(payload.get("format") == FORMAT, f"malformed payload: format {payload.get('format')!r}, expected {FORMAT!r}")
    transport = payload.get("transport")
    if transport == stream.TRANSPORT:
        return stream.receive_stream(payload, current_version=current_version, expected=expected, apply=apply,
                                     staging=staging)
    need(transport == cuda_ipc.TRANSPORT, f"malformed payload: transport {transport!r}, expected one of {TRANSPORTS}")
    state, version = cuda_ipc.receive_cuda_ipc(payload, current_version=current_version, expected=expected)
    if apply is not None:
        try:
            apply(state, version)
        except ValueError as e:  # load_weights refuses before copying anything
            raise e if isinstance(e, TransferError) else TransferError(str(e)) from e
    return state, version


def load_payload(engine, payload: dict, staging: dict | None = None) -> int:
    """``receive`` against ``engine`` (its version and its tensors as ``expected``), loading into it
    with ``engine.load_weights``. Returns the new version; raises ``TransferError`` with the engine
    untouched. ``staging``: see ``receive``."""
    _, version = receive(payload, current_version=engine.weight_version, expected=engine_tensors(engine),
                         apply=engine.load_weights, staging=staging)
    return version
