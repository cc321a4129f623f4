"""Reading a torch.distributed.checkpoint (DCP) directory without running code from it.

DCP unpickles twice while loading: its ``.metadata`` file (``FileSystemReader.read_metadata``,
plain ``pickle.load``) and every non-tensor item (``DefaultLoadPlanner.load_bytes``,
``torch.load(weights_only=False)``). Either pickle can name any callable, so a planted file runs
code in the loading process. This module owns the two replacements every DCP load of k3rl uses:

- ``VerifiedFileSystemReader``: reads ``.metadata`` into memory once, checks those bytes against the
  sha256 its caller recorded (the trainer state's manifest), and only then unpickles them with
  ``restricted_loads``, which resolves only the classes DCP metadata is made of (an allowlist: any
  other global, ``os.system`` or ``builtins.eval`` alike, raises ``UnsafePickleError`` before
  anything is called). The data files the metadata points at must be ones the manifest lists.
- ``SafeLoadPlanner``: DCP's default planner with non-tensor items read by
  ``torch.load(weights_only=True)`` (torch's own restricted unpickler: containers, numbers,
  strings, tensors).

Tensors themselves are read by DCP's stock path (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["METADATA_NAME", "UnsafePickleError", "restricted_loads", "VerifiedFileSystemReader", "SafeLoadPlanner"]

METADATA_NAME = ".metadata"

# Every global a DCP ``.metadata`` written by torch 2.4 .. 2.13 (stock or O_DIRECT writer) refers to.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch's layout object
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle that names a global outside the allowlist (refused before anything is called)."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickleError(f"refusing to unpickle global {module}.{name}: not a class DCP metadata is made of")


def restricted_loads(data: bytes):
    """Unpickle ``data`` resolving only the allowlisted globals."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()


class VerifiedFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` must have sha256 ``metadata_sha256`` and is unpickled
    restrictively; ``data_files``: the only relative paths the metadata may point at."""

    def __init__(self, path: str | os.PathLike, metadata_sha256: str, data_files: set[str]):
        super().__init__(path)
        self._want = metadata_sha256
        self._data_files = set(data_files)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """The checked metadata, read and verified on the first call and kept (later calls, DCP's
        own included, get the same verified object with a fresh ``load_id``)."""
        if kwargs.get("rank") is not None:
            raise ValueError("per-rank DCP metadata files are not read by k3rl (one .metadata per checkpoint)")
        if self._metadata is None:
            self._metadata = self._read_verified()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def _read_verified(self) -> Metadata:
        path = Path(self.path) / METADATA_NAME
        with open(path, "rb") as f:
            data = f.read()
        got = hashlib.sha256(data).hexdigest()
        if got != self._want:
            raise UnsafePickleError(f"{path}: sha256 {got} is not the recorded {self._want}: refusing to unpickle it "
                                    f"(the file changed after the checkpoint was written)")
        try:
            metadata = restricted_loads(data)
        except UnsafePickleError as e:
            raise UnsafePickleError(f"{path}: {e}") from None
        if not isinstance(metadata, Metadata):
            raise UnsafePickleError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
        for info in (metadata.storage_data or {}).values():
            rel = getattr(info, "relative_path", None)
            if rel not in self._data_files:
                raise UnsafePickleError(f"{path}: points at data file {rel!r}, which the manifest does not list")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            why = next((ln.strip() for ln in str(e).splitlines() if "Unsupported global" in ln), str(e).splitlines()[0])
            raise UnsafePickleError(f"DCP item {read_item.dest_index.fqn!r} refused by the restricted unpickler: "
                                    f"{why}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def verified_dcp_reader(path: str | os.PathLike, must_list: tuple[str, ...] = (), manifest: dict | None = None
                        ) -> VerifiedFileSystemReader:
    """A reader for the DCP directory ``path`` after its manifest (required) checks out: every file
    listed present with its size and sha256, ``.metadata`` and ``must_list`` among them. Raises
    ``ManifestError`` naming the first file that does not. ``manifest``: one the caller has just
    verified with ``verify_manifest`` (not hashed again)."""
    from k3core.checkpoint.manifest import verify_manifest

    path = Path(path)
    if manifest is None:
        manifest = verify_manifest(path, required=True, must_list=(METADATA_NAME, *must_list))
    files = manifest["files"]
    reader = VerifiedFileSystemReader(path, files[METADATA_NAME]["sha256"], set(files) - {METADATA_NAME})
    reader.read_metadata()  # now, so a refusal is this error and not one wrapped by DCP
    return reader


def safe_dcp_load(state: dict, path: str | os.PathLike, must_list: tuple[str, ...] = (),
                  manifest: dict | None = None) -> None:
    """``dcp.load(state, ...)`` from ``path`` through the verified reader and the safe planner. A
    refusal raises ``ManifestError`` or ``UnsafePickleError`` itself, not DCP's
    ``CheckpointException`` (a ``BaseException``) around it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = verified_dcp_reader(path, must_list, manifest)
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as e:
        for exc in (v[0] if isinstance(v, tuple) else v for v in e.failures.values()):
            if isinstance(exc, UnsafePickleError):
                raise exc from None
        raise


def validate_dcp(path: str | os.PathLike, must_list: tuple[str, ...] = ()) -> dict:
    """Check a DCP directory without loading it: manifest, ``.metadata`` (hash, restricted
    unpickling, data files it names). A small report of what was checked."""
    reader = verified_dcp_reader(path, must_list)
    metadata = reader.read_metadata()
    files = {getattr(i, "relative_path", None) for i in (metadata.storage_data or {}).values()}
    return {"ok": True, "path": str(Path(path).absolute()), "format": "dcp",
            "items": len(metadata.state_dict_metadata), "data_files": sorted(files),
            "manifest": {"checked": True, "files": len(reader._data_files) + 1}}
