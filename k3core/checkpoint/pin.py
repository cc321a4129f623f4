"""Pins: what a checkpoint must be, by hash, before anything trusts it.

A pin file is JSON::

    {"config_sha256": "<hex>", "index_sha256": "<hex>",
     "files": {"model-00001-of-00096.safetensors": "<hex>", ...}}   # "files" optional

``config_sha256``/``index_sha256`` are required: the index names every shard and every key, so
pinning it pins the structure; ``files`` pins contents. ``fetch`` checks config and index against
the pin before it downloads a single weight shard, and every pinned file before it publishes it;
``validate_checkpoint`` checks every file it hashes.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from k3core.checkpoint.files import CONFIG_NAME, INDEX_NAME, atomic_write_json, sha256_file

__all__ = ["Pin", "PinMismatchError", "load_pin", "make_pin", "write_pin"]

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class PinMismatchError(ValueError):
    """A file whose sha256 differs from the pin (or a pin that cannot be read)."""


@dataclass(frozen=True)
class Pin:
    config_sha256: str
    index_sha256: str
    files: dict[str, str] = field(default_factory=dict)

    def expected(self, name: str) -> str | None:
        """The pinned sha256 of a file (relative name), or None when the pin says nothing about it."""
        if name == CONFIG_NAME:
            return self.config_sha256
        if name == INDEX_NAME:
            return self.index_sha256
        return self.files.get(name)

    def check(self, name: str, sha256: str) -> None:
        want = self.expected(name)
        if want is not None and want != sha256:
            raise PinMismatchError(f"{name}: sha256 {sha256} does not match the pin ({want}): refusing it")

    def to_dict(self) -> dict:
        d = {"config_sha256": self.config_sha256, "index_sha256": self.index_sha256}
        if self.files:
            d["files"] = dict(sorted(self.files.items()))
        return d


def load_pin(path_or_dict: str | os.PathLike | dict) -> Pin:
    if isinstance(path_or_dict, dict):
        d = path_or_dict
    else:
        try:
            with open(path_or_dict) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PinMismatchError(f"cannot read pin file {path_or_dict}: {e}") from e
    if not isinstance(d, dict):
        raise PinMismatchError("a pin must be a JSON object")
    files = d.get("files") or {}
    bad = [k for k in ("config_sha256", "index_sha256") if not _HEX64.match(str(d.get(k, "")))]
    bad += [f"files[{k!r}]" for k, v in files.items() if not _HEX64.match(str(v))]
    if bad or not isinstance(files, dict):
        raise PinMismatchError(f"pin: {', '.join(bad) or 'files'} must be lowercase hex sha256 digests")
    unknown = set(d) - {"config_sha256", "index_sha256", "files"}
    if unknown:
        raise PinMismatchError(f"pin: unknown fields {sorted(unknown)}")
    return Pin(d["config_sha256"], d["index_sha256"], dict(files))


def make_pin(checkpoint_dir: str | os.PathLike, per_file: bool = True) -> Pin:
    """Pin a local checkpoint as it is now (config, index, and with ``per_file`` every shard the
    index names)."""
    root = Path(checkpoint_dir)
    files = {}
    if per_file:
        with open(root / INDEX_NAME) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = {s: sha256_file(root / s) for s in shards}
    return Pin(sha256_file(root / CONFIG_NAME), sha256_file(root / INDEX_NAME), files)


def write_pin(pin: Pin, path: str | os.PathLike) -> None:
    atomic_write_json(path, pin.to_dict())
