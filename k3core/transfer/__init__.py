"""Trainer -> rollout-engine weight transfer: versioned, checksummed, bucketed, over three paths.

Owns getting a trainer's native state dict (``K3ForCausalLM.state_dict()``) into a rollout engine
as a new weight version, and refusing anything that is not exactly that:

- in-process: ``push_inprocess(engine, named_tensors, version, quantize_experts=...)`` calls
  ``engine.load_weights`` with the trainer's tensors (no copy before the engine's own);
- another process on the same host, one path with one receiver: ``send_shm_stream`` moves the
  weights through a fixed ring of ``ring`` shared-memory buckets (filled while the receiver copies
  the previous one out, flow control over a Unix-domain socket), so /dev/shm peaks at
  ``ring * bucket_bytes`` whatever the model size (``stream.py``); between GPU processes
  ``send_cuda_ipc`` shares buckets in GPU memory by CUDA IPC handle instead (``cuda_ipc.py``).
  Either sender returns a handle whose JSON ``payload`` the receiving process gives to
  ``receive(payload)`` or ``load_payload(engine, payload)`` (receive against the engine, then load;
  what the server's ``/update_weights_from_tensor`` calls), which read the payload's transport;
- disk: ``write_disk(path, model_or_state, config, version, quantize_experts)`` publishes a public
  layout checkpoint (MXFP4 routed experts when quantised) with ``weight_version.json`` atomically;
  ``read_disk(path)`` returns (state dict, version) for ``update_weights_from_disk``
  (``load_disk(engine, path)``: read shaped for the engine, then load).

Routed experts are re-quantised to MXFP4 on the way when the engine runs quantised, and travel as
MXFP4 bytes (``wire.py``). Every tensor carries a content digest (``digest.py``: xxh3-128 when the
``xxhash`` package is installed, sha256 otherwise, ``sum64`` on CUDA; its plain reference in
``naive.py``); a bad digest, shape, dtype, name set, a missing segment or a version not newer than
the receiver's raises ``TransferError`` before the engine is touched (``verify.py``: the checks both
cross-process transports share).

Does not own: the engine (``k3core.rollout.engine``: ``load_weights`` copies, recomputes derived
caches and publishes the version), the checkpoint layout (``k3core.checkpoint``), the MXFP4 codec.
"""

from k3core.transfer.cuda_ipc import SentTransfer, send_cuda_ipc
from k3core.transfer.digest import ALGOS, available_algos, default_algo, tensor_digest
from k3core.transfer.disk import VERSION_FILE, load_disk, read_disk, read_version, write_disk
from k3core.transfer.inprocess import engine_tensors, push_inprocess
from k3core.transfer.receive import load_payload, receive
from k3core.transfer.segments import SHM_PREFIX, live_segments
from k3core.transfer.stream import StreamedSend, receive_stream, send_shm_stream
from k3core.transfer.wire import DEFAULT_BUCKET_BYTES, FORMAT, TransferError, TransferReport, iter_wire, wire_nbytes

__all__ = [
    "TransferError", "TransferReport", "SentTransfer", "StreamedSend",
    "push_inprocess", "send_shm_stream", "send_cuda_ipc", "receive", "receive_stream", "load_payload",
    "write_disk", "read_disk", "read_version", "load_disk",
    "engine_tensors", "iter_wire", "wire_nbytes", "tensor_digest", "default_algo", "available_algos", "live_segments",
    "ALGOS", "FORMAT", "DEFAULT_BUCKET_BYTES", "SHM_PREFIX", "VERSION_FILE",
]
