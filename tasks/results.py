"""Stage results persisted as plain JSON, and read back only when they are.

Prefect persists a task's result as a record that names its own serializer, and deserializes it with
whatever serializer the record names, pickle included, even when only checking whether a cached
result exists. The records live under the artifact root, which may be shared (``s3://``): anyone who
can write there could otherwise run code in the next run. So:

- ``StageResultSerializer`` writes JSON holding only JSON values and ``Artifact`` handles, and reads
  back only that (no class names are resolved from the data);
- ``TrustedCache`` wraps the stages' cache policy: when it computes a key, any file stored under that
  key that is not such a record (a planted pickle, a foreign serializer, bytes that are not a
  record) is moved aside before Prefect looks it up. The lookup is then a miss: the stage runs
  again, finds its published artifact and writes a JSON record.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.serializers import Serializer
from pydantic import Field

from k3core.artifacts import Artifact

SERIALIZER_TYPE = "k3rl-json"
_ARTIFACT_KEY = "__k3rl_artifact__"
_ARTIFACT_FIELDS = {f.name for f in dataclasses.fields(Artifact)}


def _encode(obj: Any) -> Any:
    if isinstance(obj, Artifact):
        return {_ARTIFACT_KEY: _encode(obj.to_dict())}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"stage results are JSON: dict keys must be str, got {sorted(map(repr, obj))[:3]}")
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    raise TypeError(f"stage results are JSON values and Artifact handles; got {type(obj).__name__}")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_ARTIFACT_KEY}:
            fields = obj[_ARTIFACT_KEY]
            if not isinstance(fields, dict) or not set(fields) <= _ARTIFACT_FIELDS:
                raise ValueError("malformed Artifact in a stage result")
            return Artifact.from_dict({k: _decode(v) for k, v in fields.items()})
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


class StageResultSerializer(Serializer):
    """JSON values and ``Artifact`` handles, nothing else."""

    type: str = Field(default=SERIALIZER_TYPE, frozen=True)

    def dumps(self, obj: Any) -> bytes:
        return json.dumps(_encode(obj), sort_keys=True).encode()

    def loads(self, blob: bytes) -> Any:
        return _decode(json.loads(blob))


def declared_serializer(record: bytes) -> str | None:
    """The serializer type a persisted Prefect result record declares (None: not a record)."""
    try:
        meta = json.loads(record).get("metadata") or {}
        return (meta.get("serializer") or {}).get("type")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None


@dataclass
class TrustedCache(CachePolicy):
    """``inner``'s cache key, after making sure the record stored under it (in ``root``) is one k3rl
    wrote: any other file there is moved aside to ``<key>.refused`` before Prefect looks at it, so
    the lookup is a miss and the stage runs again instead of unpickling it."""

    inner: CachePolicy | None = None
    root: str = ""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        key = self.inner.compute_key(task_ctx, inputs, flow_parameters, **kwargs) if self.inner else None
        if key is not None and self.root:
            refuse_untrusted(Path(self.root) / key)
        return key


def refuse_untrusted(record: Path) -> bool:
    """Move ``record`` aside when it is not a k3rl JSON result record; True when it was."""
    try:
        content = record.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return False
    kind = declared_serializer(content)
    if kind == SERIALIZER_TYPE:
        return False
    os.replace(record, record.with_name(record.name + ".refused"))
    logging.getLogger("k3rl").warning(f"refused the stage result record {record}: it declares serializer {kind!r}, "
                                      f"k3rl reads only {SERIALIZER_TYPE!r} records (moved aside; the stage runs again)")
    return True
