"""What a weight transfer sends, independent of how it travels: wire items, manifest entries, digests.

Owns: the error type (``TransferError``), the list of tensors a trainer state becomes on the wire
(``iter_wire``: routed experts re-quantised to MXFP4 when the engine runs quantised), the manifest
entry of each (JSON), the bucket and content digests, and the ``TransferReport`` every path returns.
Does not own: moving bytes (``inprocess.py``, ``stream.py``, ``cuda_ipc.py``, ``disk.py``), checking
a payload (``verify.py``).

Expert modes (``quantize_experts``, ``w4a8``), as ``k3core.rl.weights.engine_state``:
- ``quantize_experts=False``: every native tensor as it is.
- ``quantize_experts=True, w4a8=True`` (the W4A8 engine, the default): each routed-expert stack
  ``...experts.w13`` / ``w2`` ``[E, out, in]`` travels as the engine's own uint8 buffers
  ``..._packed`` ``[E, out, in/2]`` and ``..._scale`` ``[E, out, in/32]``; the receiver returns them
  under those names, byte for byte.
- ``quantize_experts=True, w4a8=False`` (a float engine running MXFP4 weights): the same packed and
  scale bytes travel in one entry (``codec: "mxfp4"``) and the receiver returns
  ``dequantize(packed, scale)`` under the float name in the float dtype, which equals
  ``stages.mxfp4_roundtrip(w)``.
Either way the bytes moved for an expert weight are its MXFP4 bytes (17/32 byte per weight).

A manifest entry (one per wire item; offsets are into its bucket; ``digest`` uses the payload's
``hash`` algorithm, see ``digest.py``)::

    {"name": str, "dtype": "float32", "shape": [..], "offset": int, "nbytes": int, "digest": hex,
     # codec "mxfp4" only: the bytes at offset are the packed codes [.., in/2] (uint8), and
     "codec": "mxfp4", "scale": {"offset": int, "nbytes": int, "digest": hex}}

A bucket's digest is sha256 over the canonical JSON of its entry list (which pins every tensor's
content digest, offset, dtype and shape); ``content_sha256`` is sha256 over the sorted (name, dtype,
shape, codec, digest) of every item, changed or not: it names the weights whatever the path,
bucketing or version, for a given digest algorithm.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from collections.abc import Iterator, Mapping

import torch

__all__ = ["TransferError", "FORMAT", "ALIGN", "DEFAULT_BUCKET_BYTES", "ROUTED_EXPERT_SUFFIXES", "DTYPES",
           "holds_packed_experts", "dtype_name", "parse_dtype", "WireItem", "iter_wire", "wire_nbytes", "decode_item", "item_digest",
           "bucket_digest", "content_sha256", "TransferReport", "align_up"]

FORMAT = "k3rl.weights/1"
ALIGN = 64  # every tensor starts on a cache line; any dtype view of it is aligned
DEFAULT_BUCKET_BYTES = 256 << 20
ROUTED_EXPERT_SUFFIXES = (".experts.w13", ".experts.w2")

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


class TransferError(ValueError):
    """A weight transfer refused: bad checksum, shape, dtype, name set or version, or a missing
    segment. Raised before the engine is touched, so the previous version keeps serving."""


def dtype_name(d: torch.dtype) -> str:
    name = str(d).removeprefix("torch.")
    if name not in DTYPES:
        raise TransferError(f"dtype {d} cannot travel (supported: {sorted(DTYPES)})")
    return name


def parse_dtype(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise TransferError(f"unknown dtype {name!r} in the manifest (supported: {sorted(DTYPES)})")
    return DTYPES[name]


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass
class WireItem:
    """One tensor as it travels. ``data``: the bytes at ``offset`` (the tensor itself, or the packed
    codes for ``codec="mxfp4"``); ``scale``: the MXFP4 scales (``codec="mxfp4"`` only). ``dtype`` and
    ``shape`` are what the receiver returns under ``name``."""

    name: str
    data: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    codec: str = "raw"
    scale: torch.Tensor | None = None

    def parts(self) -> list[torch.Tensor]:
        return [self.data] if self.scale is None else [self.data, self.scale]

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts())


def _is_expert(name: str) -> bool:
    return name.endswith(ROUTED_EXPERT_SUFFIXES)


def holds_packed_experts(names) -> bool:
    """Whether a receiver's tensor ``names`` hold routed experts as MXFP4 bytes (``..._packed`` and
    ``..._scale`` uint8 buffers: a W4A8 or weight-only MXFP4 engine) rather than float weights. Read
    from the names, so the transfer needs nothing of the engine but its tensors."""
    return any(n.endswith(s + "_packed") for n in names for s in ROUTED_EXPERT_SUFFIXES)


def iter_wire(named_tensors: Mapping[str, torch.Tensor], quantize_experts: bool = False,
              w4a8: bool = True) -> Iterator[WireItem]:
    """The wire items of a native state dict, in its order, produced one at a time: quantising a
    routed expert allocates only its packed codes, never the whole model's."""
    from k3core.ops import mxfp4

    for name, t in named_tensors.items():
        t = t.detach()
        if not (quantize_experts and _is_expert(name)):
            yield WireItem(name, t, t.dtype, tuple(t.shape))
            continue
        packed, scale = mxfp4.quantize(t, name=name)
        if w4a8:
            yield WireItem(name + "_packed", packed, torch.uint8, tuple(packed.shape))
            yield WireItem(name + "_scale", scale, torch.uint8, tuple(scale.shape))
        else:
            yield WireItem(name, packed, t.dtype, tuple(t.shape), "mxfp4", scale)


def wire_nbytes(named_tensors: Mapping[str, torch.Tensor], quantize_experts: bool = False) -> int:
    """Bytes ``iter_wire`` would move, from shapes alone (nothing is quantised)."""
    total = 0
    for name, t in named_tensors.items():
        if quantize_experts and _is_expert(name):
            n = t.numel()
            total += n // 2 + n // 32
        else:
            total += t.numel() * t.element_size()
    return total


def decode_item(item: WireItem) -> torch.Tensor:
    """The tensor the receiver returns for ``item`` (used where no bytes travel: in-process)."""
    if item.codec == "mxfp4":
        from k3core.ops import mxfp4

        return mxfp4.dequantize(item.data, item.scale, item.dtype)
    return item.data


def item_digest(digests: list[str]) -> str:
    """One digest for an item from its parts' digests (data, then scale)."""
    return ":".join(digests)


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def bucket_digest(entries: list[dict]) -> str:
    return hashlib.sha256(_canonical(entries)).hexdigest()


def content_sha256(items: list[tuple[str, str, list[int], str, str]], algo: str) -> str:
    """``items``: (name, dtype, shape, codec, item digest) of every tensor of the version."""
    rows = sorted([n, d, list(s), c, g] for n, d, s, c, g in items)
    return hashlib.sha256(_canonical({"hash": algo, "tensors": rows})).hexdigest()


@dataclass
class TransferReport:
    """What one transfer did. ``bytes_sent`` are the wire bytes that moved (MXFP4 bytes for quantised
    experts). ``seconds``: this side's work: the whole load for ``inprocess``, from the receiver's
    connection to its verdict for ``shm_stream`` (the receiver's load included), filling and sharing
    the buckets for ``cuda_ipc`` (the receiver's part is not in it), writing and publishing for
    ``disk``. ``buckets``: ring buckets streamed, CUDA buckets shared, shards written."""

    path: str  # "inprocess" | "shm_stream" | "cuda_ipc" | "disk"
    weight_version: int
    hash: str
    content_sha256: str
    tensors_sent: int
    bytes_sent: int
    seconds: float
    buckets: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes_sent / self.seconds / 1e9 if self.seconds > 0 else math.inf

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = self.gbps
        return d
