"""A streaming safetensors writer and a header reader.

Owns: the byte format (8-byte little-endian header length, a JSON header padded with spaces to a
multiple of 8, then the tensors' bytes back to back, exactly covering the buffer), written one
tensor at a time so a shard is never held in memory whole; and reading a file's header without
touching its data (for audits). Reading tensors is left to ``safetensors.safe_open``, the reference
implementation, which also checks every file this writer produces in the tests.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from collections.abc import Iterable, Iterator

import torch

__all__ = ["DTYPE_TO_ST", "ST_TO_DTYPE", "TensorInfo", "write_safetensors", "write_safetensors_hashed", "read_header",
           "SafetensorsFormatError"]

DTYPE_TO_ST = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
_MAX_HEADER = 100_000_000  # safetensors' own limit


class SafetensorsFormatError(ValueError):
    """A file that is not a complete, well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # offsets into the data buffer
    end: int


def write_safetensors(path: str | os.PathLike, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> int:
    """Write ``path`` from a planned header and a stream of tensors in plan order; fsync; return bytes.

    ``plan`` [(key, shape, dtype)] fixes the header before any data is written; each streamed tensor
    must match its plan line exactly (a mismatch raises and leaves a file readers reject).
    """
    return write_safetensors_hashed(path, plan, tensors, metadata)[0]


def write_safetensors_hashed(path: str | os.PathLike, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                             tensors: Iterable[tuple[str, torch.Tensor]],
                             metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """``write_safetensors``, returning (bytes, sha256 of the file) with the digest computed from the
    bytes as they are written (a manifest then needs no read-back)."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    for key, shape, dtype in plan:
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    written = 0
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for part in (struct.pack("<Q", len(hb)), hb):
            f.write(part)
            h.update(part)
        it: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
        for key, shape, dtype in plan:
            got_key, t = next(it)
            if got_key != key or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{path}: tensor {got_key!r} {t.dtype} {list(t.shape)} does not match the planned "
                                 f"{key!r} {dtype} {list(shape)}")
            t = t.detach().to("cpu").contiguous()
            if t.numel():
                data = t.view(torch.uint8).reshape(-1).numpy()
                f.write(data)
                h.update(data)
            written += t.numel() * t.element_size()
        if next(it, None) is not None:
            raise ValueError(f"{path}: more tensors than planned")
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(hb) + written, h.hexdigest()


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """(tensors, metadata, data_start) from a safetensors file's header, checking the file is whole:
    offsets contiguous from 0, no holes or overlaps, and the file exactly as long as they say."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsFormatError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsFormatError(f"{path}: header length {n} does not fit a file of {size} bytes (truncated?)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsFormatError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    infos: dict[str, TensorInfo] = {}
    for key, v in header.items():
        try:
            dt, shape, (b, e) = v["dtype"], tuple(int(x) for x in v["shape"]), v["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise SafetensorsFormatError(f"{path}: malformed header entry for {key!r}: {v!r}") from err
        if dt not in ST_TO_DTYPE:
            raise SafetensorsFormatError(f"{path}: {key!r} has unsupported dtype {dt!r}")
        if e - b != math.prod(shape) * ST_TO_DTYPE[dt].itemsize:
            raise SafetensorsFormatError(f"{path}: {key!r} spans {e - b} bytes but {dt} {list(shape)} needs "
                                         f"{math.prod(shape) * ST_TO_DTYPE[dt].itemsize}")
        infos[key] = TensorInfo(dt, shape, int(b), int(e))
    pos = 0
    for key, info in sorted(infos.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != pos:
            raise SafetensorsFormatError(f"{path}: {key!r} starts at {info.begin}, expected {pos} (hole or overlap)")
        pos = info.end
    if 8 + n + pos != size:
        raise SafetensorsFormatError(f"{path}: header describes {8 + n + pos} bytes but the file has {size} "
                                     f"({'truncated' if size < 8 + n + pos else 'trailing bytes'})")
    return infos, meta, 8 + n
