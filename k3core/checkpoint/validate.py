"""Fail-closed validation of a checkpoint directory in the public layout.

Owns: ``validate_checkpoint`` (and its JSON report). The checks, in the order the first failure is
reported:

1. ``config.json`` parses as a K3 config, its layer and routed-expert counts no larger than the
   index holds tensors for (checked before the config is built: those counts size lists) (and equals ``config`` when one is given, its vocabulary
   size and bos/eos/pad ids excepted where the checkpoint carries its own tokenizer); a
   ``quantization_config`` present must be exactly the release's MXFP4 declaration.
2. With a pin: config and index sha256 match it.
3. Index: a ``weight_map``; every MXFP4 ``weight_scale`` has its ``weight_packed`` (and back) in the
   same shard; the key set is exactly the layout's (``k3core.checkpoint.names``, the one mapping),
   vision-tower keys counted as out of scope.
4. Every shard the index names: present, a whole safetensors file (header offsets cover the file
   exactly), holding exactly the keys the index assigns to it, each with the layout's shape and dtype.
5. Streaming sha256 of every file (bounded buffer, several files at once); with a pin, every pinned
   file present and equal.
6. With a manifest (``k3rl.manifest.json``, which k3rl writes with every checkpoint it saves; pin
   or no pin): every listed file present with its size and sha256, config, index and every shard
   listed. A release fetched from elsewhere has none; a pin is how it is held to a hash.
7. Optional byte-level round trip of every text tensor public -> native -> public through the same
   ``Entry`` transforms the loader and writer use (bitwise: signed zeros and NaN payloads count).
   MXFP4 pairs go through native-shaped code/scale tensors, so their bytes are checked too.

The JSON report (counts, hashes, timing) is written atomically to ``report_path`` only when every
check passes; a stale report at that path is removed first, so a report on disk always describes a
passing checkpoint. Any failure raises ``CheckpointValidationError`` naming the first problem.

A DCP directory (a trainer state, ``.metadata`` inside; or a run checkpoint, ``state/.metadata``)
is checked instead by its manifest, which it must have, and its ``.metadata``, hashed and then
unpickled with an allowlist (``k3core.checkpoint.dcp_safe.validate_dcp``); nothing is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from k3core.checkpoint.files import CONFIG_NAME, INDEX_NAME, atomic_write_json, sha256_file
from k3core.checkpoint.manifest import MANIFEST_NAME, ManifestError, verify_manifest
from k3core.checkpoint.names import OUT_OF_SCOPE_PREFIXES, Entry, Layout, is_out_of_scope, public_layout
from k3core.checkpoint.pin import Pin, PinMismatchError, load_pin
from k3core.checkpoint.safetensors_file import ST_TO_DTYPE, SafetensorsFormatError, read_header
from k3core.config import K3Config, mxfp4_quantization_config

__all__ = ["audit_structure", "validate_checkpoint", "CheckpointValidationError", "roundtrip_checkpoint"]

ROUNDTRIP_BUFFER_BYTES = 1 << 30  # native buffer cap: stacked experts are round-tripped in chunks


class CheckpointValidationError(Exception):
    """The first check a checkpoint failed (``check`` names which)."""

    def __init__(self, check: str, message: str):
        super().__init__(f"[{check}] {message}")
        self.check = check


def _fail(check: str, message: str) -> None:
    raise CheckpointValidationError(check, message)


# ------------------------------------------------------------------------------------ config
def _has_tokenizer(root: Path) -> bool:
    from k3core.tokenizer.files import HF_TOKENIZER_FILE, TIKTOKEN_FILE

    return any((root / name).is_file() for name in (TIKTOKEN_FILE, HF_TOKENIZER_FILE))


def _vocabulary_of(config: K3Config, ckpt: K3Config) -> K3Config:
    """``config`` (a preset: the architecture) with ``ckpt``'s vocabulary size and bos/eos/pad ids,
    which a checkpoint carrying its own tokenizer decides (the tokenizer is then checked against them)."""
    return config.replace(vocab_size=ckpt.vocab_size, bos_token_id=ckpt.bos_token_id, eos_token_id=ckpt.eos_token_id,
                          pad_token_id=ckpt.pad_token_id)


def _read_json(check: str, p: Path):
    """``p``'s JSON; invalid JSON, or nesting past the parser's recursion limit, fails ``check``
    naming the file (a recursion error would otherwise surface as a traceback)."""
    try:
        with open(p) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _fail(check, f"{p}: not valid JSON ({e})")
    except RecursionError:
        _fail(check, f"{p}: nests too deeply to be a checkpoint's JSON")


_LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")
_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def _bound_by_index(p: Path, raw, root: Path) -> None:
    """Refuse a config whose layer or routed-expert count exceeds what the checkpoint's own index
    holds tensors for, before the config is built: a config's per-layer lists and the layout's
    per-expert entries are allocated from these counts, so ``num_hidden_layers = 10**9`` would
    exhaust memory before any check could compare it with the shards. A missing or broken index
    is left to the index check (nothing is allocated from it here)."""
    text = raw.get("text_config", raw) if isinstance(raw, dict) else None
    index = root / INDEX_NAME
    if not isinstance(text, dict) or not index.is_file():
        return
    wm = _read_json("index", index)
    keys = wm.get("weight_map") if isinstance(wm, dict) else None
    if not isinstance(keys, dict):
        return
    held = {"num_hidden_layers": (_LAYER_KEY, "layers"), "num_experts": (_EXPERT_KEY, "routed experts")}
    for field, (pattern, what) in held.items():
        n = text.get(field)
        if not isinstance(n, int) or isinstance(n, bool):
            continue  # the config's own check names a value of the wrong type
        seen = {int(m.group(1)) for k in keys for m in [pattern.search(k)] if m and not is_out_of_scope(k)}
        have = max(seen) + 1 if seen else 0
        if n > have:
            _fail("config", f"{p}: {field} is {n}, but {index.name} holds tensors of {have} {what}: a config "
                            f"describing more than its checkpoint holds is refused before anything is sized from it")


def _audit_config(root: Path, config: K3Config | None) -> tuple[K3Config, str, K3Config]:
    """(the checkpoint's config, its layout target, the config it must match: ``config``, sized to
    the checkpoint's own tokenizer where it carries one, else the checkpoint's own)."""
    p = root / CONFIG_NAME
    if not p.is_file():
        _fail("config", f"{p} is missing")
    raw = _read_json("config", p)
    _bound_by_index(p, raw, root)
    try:
        ckpt = K3Config.from_hf_dict(raw)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        _fail("config", f"{p}: {e}")
    text = raw.get("text_config", raw) if isinstance(raw, dict) else {}
    qc = text.get("quantization_config")
    if qc is not None and qc != mxfp4_quantization_config():
        want = mxfp4_quantization_config()
        diff = sorted(k for k in set(qc) | set(want) if qc.get(k) != want.get(k)) if isinstance(qc, dict) else ["<not an object>"]
        _fail("quantization_config", f"{p}: quantization_config differs from the release's MXFP4 declaration "
                                     f"in {diff} (see k3core.config.mxfp4_quantization_config())")
    if config is not None and _has_tokenizer(root):
        config = _vocabulary_of(config, ckpt)
    if config is not None:
        a = config.replace(quantization_config=None).to_hf_dict()["text_config"]
        b = ckpt.replace(quantization_config=None).to_hf_dict()["text_config"]
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if diff:
            _fail("config", f"{p} does not describe the expected model: {diff[0]} is {b.get(diff[0])!r}, "
                            f"expected {a.get(diff[0])!r}")
    return ckpt, ("mxfp4" if qc is not None else "bf16"), config or ckpt


def _audit_tokenizer(root: Path, config: K3Config) -> dict | None:
    """The checkpoint's tokenizer files (``tiktoken.model``, ``tokenizer.json``) read as data
    (``k3core.tokenizer.load_tokenizer``, never the checkpoint's code) and checked against the model:
    every id it produces has an embedding row and its bos/eos/pad are the config's. None when the
    checkpoint carries no tokenizer files."""
    from k3core.tokenizer import check_against_config, load_tokenizer

    if not _has_tokenizer(root):
        return None
    try:
        tok = load_tokenizer(root, config)
        check_against_config(tok, config)
    except (ValueError, OSError) as e:
        _fail("tokenizer", f"{root}: {e}")
    return {"format": type(tok).__name__, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
            "pad_id": tok.pad_id, "chat_template": tok.chat_template is not None}


# ------------------------------------------------------------------------------------- index
def _read_weight_map(root: Path) -> tuple[dict[str, str], dict]:
    p = root / INDEX_NAME
    if not p.is_file():
        _fail("index", f"{p} is missing")
    index = _read_json("index", p)
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        _fail("index", f"{p}: no 'weight_map' object of key -> shard file name")
    for shard in set(wm.values()):
        if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            _fail("index", f"{p}: shard name {shard!r} is not a plain file name")
    return wm, index


def _audit_pairs(wm: dict[str, str]) -> int:
    pairs = 0
    for key, shard in wm.items():
        for have, other in ((".weight_scale", ".weight_packed"), (".weight_packed", ".weight_scale")):
            if key.endswith(have):
                partner = key[: -len(have)] + other
                if partner not in wm:
                    _fail("mxfp4_pair", f"{key!r} has no {other[1:]} partner ({partner!r} is not in the index)")
                if wm[partner] != shard:
                    _fail("mxfp4_pair", f"{key!r} is in {shard} but {partner!r} is in {wm[partner]}: a pair must share a shard")
                pairs += have == ".weight_packed"
    return pairs


def _audit_keys(layout: Layout, wm: dict[str, str]) -> int:
    out_of_scope = 0
    for key in sorted(wm):
        if key in layout.by_key:
            continue
        if is_out_of_scope(key):
            out_of_scope += 1
            continue
        _fail("unexpected_tensor", f"{key!r} (in {wm[key]}) is not part of the {layout.target} layout of this config")
    for key in layout.by_key:
        if key not in wm:
            _fail("missing_tensor", f"{key!r} is not in the index ({layout.target} layout of this config)")
    return out_of_scope


def _audit_shards(root: Path, layout: Layout, wm: dict[str, str]) -> dict[str, int]:
    by_shard: dict[str, set[str]] = defaultdict(set)
    for key, shard in wm.items():
        by_shard[shard].add(key)
    stored = layout.stored_keys()
    total = 0
    for shard in sorted(by_shard):
        p = root / shard
        if not p.is_file():
            _fail("missing_shard", f"{shard} is named by the index but does not exist")
        try:
            infos, _, _ = read_header(p)
        except SafetensorsFormatError as e:
            _fail("shard_format", str(e))
        extra = sorted(set(infos) - by_shard[shard])
        if extra:
            _fail("unexpected_tensor", f"{shard} holds {extra[0]!r}, which the index does not assign to it")
        for key in sorted(by_shard[shard]):
            if key not in infos:
                _fail("missing_tensor", f"the index assigns {key!r} to {shard}, which does not hold it")
            info = infos[key]
            total += info.end - info.begin
            if key not in stored:
                continue  # out of scope (vision tower): present and well-formed is all we ask
            shape, dtype = stored[key]
            if ST_TO_DTYPE[info.dtype] != dtype:
                _fail("dtype", f"{key!r} in {shard} is {info.dtype}, expected {dtype}")
            if info.shape != tuple(shape):
                _fail("shape", f"{key!r} in {shard} has shape {list(info.shape)}, expected {list(shape)}")
    return {"tensor_bytes": total, "shards": len(by_shard)}


# ----------------------------------------------------------------------------------- hashes
def _hash_all(root: Path, workers: int) -> dict[str, dict]:
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(sha256_file, files))
    return {p.relative_to(root).as_posix(): {"sha256": d, "size": p.stat().st_size} for p, d in zip(files, digests)}


def _check_pin_heads(root: Path, pin: Pin) -> None:
    for name in (CONFIG_NAME, INDEX_NAME):
        try:
            pin.check(name, sha256_file(root / name))
        except PinMismatchError as e:
            _fail("pin", str(e))


def _check_pin_files(pin: Pin, hashes: dict[str, dict]) -> int:
    for name in sorted(pin.files):
        if name not in hashes:
            _fail("pin", f"{name} is pinned but missing")
        try:
            pin.check(name, hashes[name]["sha256"])
        except PinMismatchError as e:
            _fail("pin", str(e))
    return len(pin.files) + 2


# ------------------------------------------------------------------------------- round trip
def _native_buffers(native_shape: tuple[int, ...], ent: Entry, layout: Layout, device="cpu") -> list[torch.Tensor]:
    """Empty native-shaped buffers for one native tensor: one in the public dtype, or (codes, scales)
    for MXFP4, whose trailing dim is the packed/scale width of the same rows."""
    if ent.codec != "mxfp4":
        return [torch.empty(native_shape, dtype=ent.dtype, device=device)]
    (_, ps, _), (_, ss, _) = ent.stored()
    lead = native_shape[:-1]
    return [torch.empty(*lead, ps[-1], dtype=torch.uint8, device=device),
            torch.empty(*lead, ss[-1], dtype=torch.uint8, device=device)]


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    """-1 when bitwise equal, else the first differing byte offset."""
    ua, ub = a.contiguous().view(torch.uint8).reshape(-1), b.contiguous().view(torch.uint8).reshape(-1)
    if ua.shape != ub.shape:
        return 0
    ne = (ua != ub).nonzero()
    return -1 if ne.numel() == 0 else int(ne[0])


def roundtrip_checkpoint(root: str | os.PathLike, layout: Layout, wm: dict[str, str],
                         buffer_bytes: int = ROUNDTRIP_BUFFER_BYTES) -> dict[str, int]:
    """Public -> native -> public for every text tensor, bitwise. Raises on the first difference."""
    from safetensors import safe_open

    root = Path(root)
    handles: dict[str, object] = {}

    def read(key: str) -> torch.Tensor:
        shard = wm[key]
        if shard not in handles:
            handles[shard] = safe_open(str(root / shard), framework="pt", device="cpu")
        return handles[shard].get_tensor(key)

    groups: dict[str, list[Entry]] = defaultdict(list)
    for ent in layout.entries:
        groups[ent.native].append(ent)
    n = nbytes = 0
    for native, entries in groups.items():
        shape = layout.native[native]
        # stacked experts: chunks of experts, so the native buffer stays bounded
        if entries[0].expert is not None:
            per_expert = max(1, sum(e.nbytes() for e in entries) // shape[0])
            step = max(1, buffer_bytes // per_expert)
            chunks = [(e0, min(e0 + step, shape[0])) for e0 in range(0, shape[0], step)]
        else:
            chunks = [(None, None)]
        for e0, e1 in chunks:
            sel = entries if e0 is None else [dataclasses.replace(e, expert=e.expert - e0) for e in entries
                                              if e0 <= e.expert < e1]
            cshape = shape if e0 is None else (e1 - e0, *shape[1:])
            bufs = _native_buffers(cshape, sel[0], layout)
            stored = {}
            for ent in sel:  # public -> native (the loader's transform, minus dequantisation)
                tensors = [read(k) for k, _, _ in ent.stored()]
                stored[ent.public] = tensors
                if ent.codec == "mxfp4":
                    for buf, t in zip(bufs, tensors):
                        ent.native_view(buf).copy_(t)
                else:
                    try:
                        ent.native_view(bufs[0]).copy_(ent.narrow_public(tensors[0]))
                    except ValueError as e:
                        _fail("roundtrip", str(e))
            for ent in sel:  # native -> public (the writer's transform, minus quantisation)
                if ent.codec == "mxfp4":
                    again = [ent.native_view(b).contiguous() for b in bufs]
                else:
                    again = [ent.to_public(bufs[0])]
                for (key, _, _), a, b in zip(ent.stored(), stored[ent.public], again):
                    off = _bytes_equal(a, b)
                    if off >= 0:
                        _fail("roundtrip", f"{key!r}: public -> native -> public changes byte {off} "
                                           f"({a.dtype} {list(a.shape)} -> {b.dtype} {list(b.shape)})")
                    n += 1
                    nbytes += a.numel() * a.element_size()
    return {"tensors": n, "bytes": nbytes}


# -------------------------------------------------------------------------------------- DCP
def _validate_dcp_dir(root: Path, pin) -> dict:
    from k3core.checkpoint.dcp_safe import UnsafePickleError, validate_dcp

    if pin is not None:
        _fail("pin", f"{root} is a DCP trainer state: pins describe public-layout checkpoints (its manifest is checked)")
    try:
        return validate_dcp(root)
    except ManifestError as e:
        _fail("manifest", str(e))
    except UnsafePickleError as e:
        _fail("dcp_metadata", str(e))


# ------------------------------------------------------------------------------------- main
def audit_structure(path: str | os.PathLike, config: K3Config | None = None) -> K3Config:
    """Checks 1, 3 and 4 alone (config, index, every shard's header against the layout), no hashing:
    what a command checks of a checkpoint it is given before any work starts. Reading one header
    per shard is cheap at any size; a truncated, missing or mis-shaped shard is found here. Returns
    the checkpoint's config; raises ``CheckpointValidationError`` on the first failed check."""
    root = Path(path)
    if not root.is_dir():
        _fail("path", f"{root} is not a directory")
    ckpt_cfg, target, expected = _audit_config(root, config)
    _audit_tokenizer(root, expected)
    wm, _ = _read_weight_map(root)
    _audit_pairs(wm)
    layout = public_layout(expected, target)
    _audit_keys(layout, wm)
    _audit_shards(root, layout, wm)
    return ckpt_cfg


def validate_checkpoint(path: str | os.PathLike, config: K3Config | None = None,
                        pin: str | os.PathLike | dict | Pin | None = None,
                        report_path: str | os.PathLike | None = None, roundtrip: bool = False,
                        workers: int = 4) -> dict:
    """Validate the checkpoint at ``path`` (see the module docstring); return the report dict.

    ``config``: the model the checkpoint must be (default: its own ``config.json``).
    ``pin``: a pin file/dict (``k3core.checkpoint.pin``). ``report_path``: where to publish the JSON
    report on success. Raises ``CheckpointValidationError`` on the first failed check.
    """
    t0 = time.monotonic()
    root = Path(path)
    if report_path is not None:
        Path(report_path).unlink(missing_ok=True)
    if not root.is_dir():
        _fail("path", f"{root} is not a directory")
    dcp_dir = root if (root / ".metadata").is_file() else root / "state" if (root / "state" / ".metadata").is_file() else None
    if dcp_dir is not None:
        report = _validate_dcp_dir(dcp_dir, pin)
        report["timing_s"] = {"total": round(time.monotonic() - t0, 3)}
        if report_path is not None:
            atomic_write_json(report_path, report)
        return report
    try:
        pin_obj = pin if isinstance(pin, Pin) or pin is None else load_pin(pin)
    except PinMismatchError as e:
        _fail("pin", str(e))
    ckpt_cfg, target, expected = _audit_config(root, config)
    tokenizer = _audit_tokenizer(root, expected)
    if pin_obj is not None:
        _check_pin_heads(root, pin_obj)
    wm, index = _read_weight_map(root)
    pairs = _audit_pairs(wm)
    layout = public_layout(expected, target)
    out_of_scope = _audit_keys(layout, wm)
    shard_stats = _audit_shards(root, layout, wm)
    t_audit = time.monotonic()
    hashes = _hash_all(root, workers)
    pinned = _check_pin_files(pin_obj, hashes) if pin_obj is not None else 0
    try:
        manifest = verify_manifest(root, must_list={CONFIG_NAME, INDEX_NAME, *wm.values()},
                                   hashes={n: h["sha256"] for n, h in hashes.items()})
    except ManifestError as e:
        _fail("manifest", str(e))
    t_hash = time.monotonic()
    rt = roundtrip_checkpoint(root, layout, wm) if roundtrip else None
    t_rt = time.monotonic()
    shards = sorted(set(wm.values()))
    oos_shards = sorted({wm[k] for k in wm if is_out_of_scope(k)})
    report = {
        "ok": True,
        "path": str(root.absolute()),
        "format": target,
        "config_sha256": hashes[CONFIG_NAME]["sha256"],
        "index_sha256": hashes[INDEX_NAME]["sha256"],
        "counts": {
            "files": len(hashes),
            "shards": len(shards),
            "index_keys": len(wm),
            "text_tensors": len(layout.entries),  # logical: an MXFP4 pair counts once
            "stored_text_tensors": len(layout.by_key),
            "mxfp4_pairs": pairs,
            "out_of_scope_tensors": out_of_scope,
            "tensor_bytes": shard_stats["tensor_bytes"],
            "file_bytes": sum(h["size"] for h in hashes.values()),
        },
        "tokenizer": tokenizer,
        "index_total_size": (index.get("metadata") or {}).get("total_size"),
        "out_of_scope": {"prefixes": list(OUT_OF_SCOPE_PREFIXES), "tensors": out_of_scope, "shards_with_any": oos_shards,
                         "note": "vision tower / projector: recognised, hashed, not audited (text backbone only)"},
        "unreferenced_files": sorted(n for n in hashes if n not in shards and n not in (CONFIG_NAME, INDEX_NAME, MANIFEST_NAME)),
        "manifest": {"checked": manifest is not None, "files_checked": len(manifest["files"]) if manifest else 0},
        "pin": {"checked": pin_obj is not None, "files_checked": pinned},
        "roundtrip": rt,
        "files": hashes,
        "timing_s": {"audit": round(t_audit - t0, 3), "hash": round(t_hash - t_audit, 3),
                     "roundtrip": round(t_rt - t_hash, 3), "total": round(time.monotonic() - t0, 3)},
    }
    if report_path is not None:
        atomic_write_json(report_path, report)
    return report
