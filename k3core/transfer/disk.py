"""Weight transfer through disk, in the public layout an engine's ``update_weights_from_disk`` reads.

Owns: ``write_disk`` (trainer state -> a versioned, checksummed public checkpoint, published in one
step), ``read_disk`` (that directory -> a verified native state dict and its version) and
``load_disk(engine, path)`` (read_disk shaped for an engine, then ``load_weights``: what
``update_weights_from_disk`` does). The
checkpoint itself is ``k3core.checkpoint.hf.save_hf``'s: shards, ``config.json``, then the index
last; MXFP4 routed experts (``target="mxfp4"``) when the engine runs quantised. Beside it,
``weight_version.json``::

    {"format": "k3rl.weights/1", "transport": "disk", "weight_version": int, "hash": algo,
     "target": "bf16" | "mxfp4", "content_sha256": hex, "num_tensors": int,
     "shards": {file: {"digest": hex, "tensors": [{"name", "dtype", "shape", "offset", "nbytes", "digest"}]}}}

with one entry per stored safetensors key (offsets into the shard's data section), digests of the
bytes as stored (read back after the write), and per shard the sha256 of its entry list.

Publication: everything (checkpoint, then ``weight_version.json``) is written into a staging
directory beside ``path``, fsync'ed, and swapped in for ``path`` in one step
(``k3core.checkpoint.files.publish_dir``), so a reader sees the old version or the new one, whole.
A reader racing a swap could still read the version file of one and a shard of the other; every
tensor's digest is checked against the version file it read, so such a mix is refused
(``TransferError``; read again), never returned.

Precision: the public layout stores bf16 (fp32 for the tensors the release keeps fp32), so an fp32
trainer's weights arrive rounded to bf16; a bf16 trainer's arrive bit for bit. Memory: the writer
holds one public tensor at a time; the reader maps each shard and builds the returned state dict
(the only full copy) directly from the mapping.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from collections.abc import Mapping

import torch
from torch import nn

from k3core.transfer.digest import check_algo, default_algo, tensor_digest
from k3core.transfer.inprocess import engine_tensors
from k3core.transfer.wire import (FORMAT, ROUTED_EXPERT_SUFFIXES, TransferError, TransferReport, bucket_digest,
                                  content_sha256, dtype_name, holds_packed_experts, parse_dtype)

__all__ = ["VERSION_FILE", "write_disk", "read_disk", "read_version", "load_disk"]

VERSION_FILE = "weight_version.json"


def _owned(name: str) -> bool:
    """Files ``write_disk`` owns in ``path`` (everything else there, e.g. a tokenizer, is kept)."""
    from k3core.checkpoint.files import CONFIG_NAME, INDEX_NAME
    from k3core.checkpoint.manifest import MANIFEST_NAME

    return (name in (INDEX_NAME, CONFIG_NAME, VERSION_FILE, MANIFEST_NAME, "model.safetensors")
            or (name.startswith("model-") and name.endswith(".safetensors")))


def _map_file(path: Path) -> torch.Tensor:
    size = os.path.getsize(path)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def _shard_entries(path: Path, algo: str) -> tuple[list[dict], torch.Tensor, int]:
    """(entries with digests, the mapped file, data start) of one safetensors shard, in file order."""
    from k3core.checkpoint.safetensors_file import ST_TO_DTYPE, read_header

    infos, _, start = read_header(path)
    buf = _map_file(path)
    ents = []
    for key, info in sorted(infos.items(), key=lambda kv: kv[1].begin):
        raw = buf[start + info.begin: start + info.end]
        ents.append({"name": key, "dtype": dtype_name(ST_TO_DTYPE[info.dtype]), "shape": list(info.shape),
                     "offset": info.begin, "nbytes": info.end - info.begin, "digest": tensor_digest(raw, algo)})
    return ents, buf, start


def write_disk(path: str | os.PathLike, model_or_state: nn.Module | Mapping[str, torch.Tensor], config=None, version: int = 0,
               quantize_experts: bool = False, *, algo: str | None = None, max_shard_bytes: int | None = None) -> TransferReport:
    """Publish ``model_or_state`` (native names) at ``path`` as weight ``version``: public layout,
    MXFP4 routed experts when ``quantize_experts``, ``weight_version.json`` with every digest."""
    from k3core.checkpoint.files import atomic_write_json, publish_dir, remove_stale_staging, staging_dir_for
    from k3core.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, save_hf

    algo = algo or default_algo("cpu")
    check_algo(algo)
    if config is None:
        config = getattr(model_or_state, "config", None)
        if config is None:
            raise ValueError("write_disk needs config= when given a state dict")
    t0 = time.perf_counter()
    path = Path(path).absolute()
    target = "mxfp4" if quantize_experts else "bf16"
    remove_stale_staging(path)
    staging = staging_dir_for(path)
    try:
        res = save_hf(model_or_state, staging, config, target=target,
                      max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        shards, rows = {}, []
        for shard in res.shards:
            ents, _, _ = _shard_entries(staging / shard, algo)
            shards[shard] = {"digest": bucket_digest(ents), "tensors": ents}
            rows += [(e["name"], e["dtype"], e["shape"], "raw", e["digest"]) for e in ents]
        content = content_sha256(rows, algo)
        atomic_write_json(staging / VERSION_FILE, {
            "format": FORMAT, "transport": "disk", "weight_version": int(version), "hash": algo, "target": target,
            "content_sha256": content, "num_tensors": len(rows), "shards": shards})
        publish_dir(staging, path, keep=lambda name: not _owned(name))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return TransferReport("disk", int(version), algo, content, len(rows), res.total_size, time.perf_counter() - t0,
                          len(res.shards), extra={"path": str(path), "target": target})


def read_version(path: str | os.PathLike) -> dict:
    """The parsed ``weight_version.json`` of ``path`` (``TransferError`` if absent or malformed)."""
    p = Path(path) / VERSION_FILE
    try:
        meta = json.loads(p.read_text())
    except FileNotFoundError:
        raise TransferError(f"{p} not found: not a checkpoint published by write_disk (or not yet complete)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise TransferError(f"{p}: unreadable ({e})") from None
    ok = (isinstance(meta, dict) and meta.get("format") == FORMAT and meta.get("transport") == "disk"
          and isinstance(meta.get("weight_version"), int) and isinstance(meta.get("shards"), dict)
          and meta.get("target") in ("bf16", "mxfp4"))
    if not ok:
        raise TransferError(f"{p}: not a {FORMAT} disk version file")
    return meta


@torch.no_grad()
def read_disk(path: str | os.PathLike, *, current_version: int | None = None, packed_experts: bool = False,
              dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """A checkpoint published by ``write_disk`` -> (native state dict, weight version), every stored
    tensor's digest checked first.

    ``packed_experts`` (an MXFP4 checkpoint, for the W4A8 engine): routed experts come back as the
    engine's ``..._packed``/``..._scale`` uint8 buffers, the stored bytes as they are; otherwise they
    are dequantised. ``dtype``: the dtype of the returned float tensors (default: as stored, bf16;
    the fp32-kept tensors stay fp32). ``current_version``: refuse a version not newer.
    """
    from k3core.checkpoint.files import CONFIG_NAME
    from k3core.checkpoint.hf import CheckpointFormatError, check_keys, checkpoint_target, read_index
    from k3core.checkpoint.names import public_dtype, public_layout
    from k3core.checkpoint.safetensors_file import SafetensorsFormatError
    from k3core.config import K3Config
    from k3core.ops import mxfp4

    path = Path(path)
    meta = read_version(path)
    version = meta["weight_version"]
    if current_version is not None and version <= current_version:
        raise TransferError(f"weight version {version} at {path} is not newer than the receiver's {current_version}: refused")
    algo = meta.get("hash")
    try:
        check_algo(algo)
        config = K3Config.from_json_file(path / CONFIG_NAME)
        target = checkpoint_target(config)
        if target != meta["target"]:
            raise TransferError(f"{path}: config.json declares {target}, the version file {meta['target']}: refused")
        if packed_experts and target != "mxfp4":
            raise TransferError(f"{path}: packed_experts needs an MXFP4 checkpoint, this one is {target}")
        layout = public_layout(config, target)
        weight_map = read_index(path)
        check_keys(layout, weight_map)
    except (CheckpointFormatError, ValueError, OSError) as e:
        if isinstance(e, TransferError):
            raise
        raise TransferError(f"{path}: {e}") from None
    if set(weight_map.values()) != set(meta["shards"]):
        raise TransferError(f"{path}: the index's shards {sorted(set(weight_map.values()))} are not the version file's "
                            f"{sorted(meta['shards'])} (a writer swapped the directory mid-read?): read again")

    # verify every shard against the version file, keeping verified views of the stored tensors
    stored: dict[str, torch.Tensor] = {}
    rows = []
    for shard, rec in meta["shards"].items():
        try:
            ents, buf, start = _shard_entries(path / shard, algo)
        except (FileNotFoundError, SafetensorsFormatError, RuntimeError) as e:
            raise TransferError(f"{path / shard}: {e}") from None
        if not isinstance(rec, dict) or bucket_digest(rec.get("tensors", [])) != rec.get("digest"):
            raise TransferError(f"{shard}: entry list does not match its digest in the version file: refused")
        want = {e["name"]: e for e in rec["tensors"]}
        got = {e["name"]: e for e in ents}
        if set(want) != set(got):
            raise TransferError(f"{shard}: holds {sorted(set(got) ^ set(want))[:3]} unlike the version file: refused")
        for name, e in got.items():
            if e != want[name]:
                bad = [k for k in e if e[k] != want[name].get(k)]
                raise TransferError(f"{shard}: {name} differs from the version file in {bad} "
                                    f"({'corrupt bytes' if bad == ['digest'] else 'layout'}): refused")
            raw = buf[start + e["offset"]: start + e["offset"] + e["nbytes"]]
            dt = parse_dtype(e["dtype"])
            if (start + e["offset"]) % dt.itemsize:
                raw = raw.clone()  # safetensors packs tensors back to back: a typed view needs alignment
            stored[name] = raw.view(dt).view(e["shape"]) if e["nbytes"] else torch.empty(e["shape"], dtype=dt)
            rows.append((name, e["dtype"], e["shape"], "raw", e["digest"]))
    if len(rows) != meta.get("num_tensors") or content_sha256(rows, algo) != meta.get("content_sha256"):
        raise TransferError(f"{path}: content digest does not match the version file: refused")

    state: dict[str, torch.Tensor] = {}
    for k, s in layout.native.items():
        keep_fp32 = public_dtype(k) == torch.float32
        if packed_experts and k.endswith(ROUTED_EXPERT_SUFFIXES):
            state[k + "_packed"] = torch.empty((*s[:-1], s[-1] // 2), dtype=torch.uint8)
            state[k + "_scale"] = torch.empty((*s[:-1], s[-1] // mxfp4.BLOCK), dtype=torch.uint8)
        else:
            state[k] = torch.empty(s, dtype=public_dtype(k) if dtype is None or keep_fp32 else dtype)
    for ent in layout.entries:
        ts = [stored[key] for key, _, _ in ent.stored()]
        if ent.codec == "mxfp4" and packed_experts:
            for suffix, t in zip(("_packed", "_scale"), ts):
                dst = state[ent.native + suffix][ent.expert]
                (dst if ent.rows is None else dst[ent.rows[0]: ent.rows[1]]).copy_(t)
            continue
        view = ent.native_view(state[ent.native])
        if ent.codec == "mxfp4":
            view.copy_(mxfp4.dequantize(ts[0], ts[1], view.dtype))
        else:
            try:
                view.copy_(ent.narrow_public(ts[0]).to(view.dtype))
            except ValueError as e:  # nonzero A_log padding
                raise TransferError(str(e)) from None
    return state, version


def load_disk(engine, path: str | os.PathLike) -> int:
    """``read_disk`` for ``engine`` (its version as ``current_version``, packed experts when the engine
    holds its experts as MXFP4 bytes, its float dtype), then ``engine.load_weights``. Returns the new
    version; raises ``TransferError`` with the engine untouched."""
    from k3core.checkpoint.names import public_dtype

    own = engine_tensors(engine)
    dtype = next((t.dtype for k, t in own.items() if t.is_floating_point() and public_dtype(k) != torch.float32), None)
    state, version = read_disk(path, current_version=engine.weight_version, dtype=dtype,
                               packed_experts=holds_packed_experts(own))
    try:
        engine.load_weights(state, version)
    except ValueError as e:
        raise e if isinstance(e, TransferError) else TransferError(str(e)) from e
    return version
