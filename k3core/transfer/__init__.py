"""Trainer -> rollout-engine weight transfer: versioned, checksummed, bucketed, over three paths.

Owns getting a trainer's native state dict (``K3ForCausalLM.state_dict()``) into a rollout engine
as a new weight version, and refusing anything that is not exactly that:

- in-process: ``push_inprocess(engine, named_tensors, version, quantize_experts=...)`` calls
  ``engine.load_weights`` with the trainer's tensors (no copy before the engine's own);
- same host, another process: ``send_shm`` (POSIX shared memory) / ``send_cuda_ipc`` (CUDA IPC
  handles) write buckets of at most ``bucket_bytes`` and return a ``SentTransfer`` whose JSON
  ``payload`` the receiver turns back into a verified state dict with ``receive(payload)`` (the
  server's ``/update_weights_from_tensor`` calls exactly that; ``load_payload(engine, payload)``
  does receive + load against an engine); the sender unlinks the buckets after the receiver's ack
  (or, with a ``ShmPool``, reuses them for the next transfer);
- same host, another process, streamed: ``send_shm_stream`` moves the same bytes through a fixed ring
  of ``ring`` shared-memory buckets (filled while the receiver copies the previous one out, with flow
  control over a Unix-domain socket), so /dev/shm peaks at ``ring * bucket_bytes`` whatever the model
  size; the receiver stages one host copy and loads it only once all of it is verified
  (``load_payload`` / ``/update_weights_from_tensor`` take its payload too; ``stream.py``);
- disk: ``write_disk(path, model_or_state, config, version, quantize_experts)`` publishes a public
  layout checkpoint (MXFP4 routed experts when quantised) with ``weight_version.json`` atomically;
  ``read_disk(path)`` returns (state dict, version) for ``update_weights_from_disk``
  (``load_disk(engine, path)``: read shaped for the engine, then load).

Routed experts are re-quantised to MXFP4 on the way when the engine runs quantised, and travel as
MXFP4 bytes (``wire.py``). Every tensor carries a content digest (``digest.py``: xxh3-128 when the
``xxhash`` package is installed, sha256 otherwise, ``sum64`` on CUDA); a bad digest, shape, dtype,
name set, a missing segment or a version not newer than the receiver's raises ``TransferError``
before the engine is touched. ``DeltaTracker`` makes any path send only the tensors whose bytes
changed since the last acknowledged version.

Does not own: the engine (``k3core.rollout.engine``: ``load_weights`` copies, recomputes derived
caches and publishes the version), the checkpoint layout (``k3core.checkpoint``), the MXFP4 codec.
"""

from k3core.transfer.delta import DeltaTracker
from k3core.transfer.digest import ALGOS, available_algos, default_algo, tensor_digest
from k3core.transfer.disk import VERSION_FILE, load_disk, read_disk, read_version, write_disk
from k3core.transfer.inprocess import engine_tensors, push_inprocess
from k3core.transfer.receive import load_payload, receive
from k3core.transfer.shm import (SHM_PREFIX, SentTransfer, ShmPool, forget_mappings, live_segments, send_cuda_ipc,
                                 send_shm)
from k3core.transfer.stream import StreamedSend, receive_stream, send_shm_stream
from k3core.transfer.wire import DEFAULT_BUCKET_BYTES, FORMAT, TransferError, TransferReport, iter_wire, wire_nbytes

__all__ = [
    "TransferError", "TransferReport", "DeltaTracker", "SentTransfer", "ShmPool",
    "push_inprocess", "send_shm", "send_shm_stream", "send_cuda_ipc", "receive", "receive_stream", "StreamedSend", "load_payload", "forget_mappings",
    "write_disk", "read_disk", "read_version", "load_disk",
    "engine_tensors", "iter_wire", "wire_nbytes", "tensor_digest", "default_algo", "available_algos", "live_segments",
    "ALGOS", "FORMAT", "DEFAULT_BUCKET_BYTES", "SHM_PREFIX", "VERSION_FILE",
]
