"""Save and load K3 checkpoints in the public Hugging Face layout (safetensors shards + index).

Owns: ``save_hf`` (native model or state dict -> public shards, bf16 or MXFP4), ``load_hf`` (public
shards -> native tensors, in place), ``load_model`` and ``init_checkpoint`` (a fresh seeded model in
the public layout). Names, shapes and dtypes come from ``k3core.checkpoint.names``.

Crash safety of ``save_hf``: shard assignment is planned up front from sizes (so every shard gets its
final ``model-000NN-of-000MM.safetensors`` name at once); shards, then ``config.json``, then
``model.safetensors.index.json`` (last, atomically: temporary name, fsync, rename, directory fsync)
and then the manifest of their sha256 (``k3rl.manifest.json``, ``k3core.checkpoint.manifest``) are
written into a staging directory beside ``path``, which then replaces ``path`` in one step
(``files.publish_dir``). A writer killed at any moment leaves the previous checkpoint at ``path``
untouched, and no index anywhere names a shard that is missing or partial.

Integrity: ``load_hf``, ``quantize_checkpoint`` (and ``load_w4a8_model``) check a checkpoint's
manifest, when it has one, before reading a tensor (``check_manifest``): a file changed since it was
written is refused with its name.

Memory: the writer holds one public tensor at a time (plus its MXFP4 codes); the reader holds one
stored tensor at a time and copies it into the native tensor's storage, so the model is never in
memory twice.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from k3core.checkpoint.files import CONFIG_NAME, INDEX_NAME, atomic_write_json, publish_dir, remove_stale_staging, staging_dir_for
from k3core.checkpoint.manifest import MANIFEST_NAME, verify_manifest, write_manifest
from k3core.checkpoint.names import Entry, Layout, is_out_of_scope, materialize, meta_model, public_dtype, public_layout
from k3core.checkpoint.safetensors_file import ST_TO_DTYPE, write_safetensors_hashed
from k3core.config import K3Config, mxfp4_quantization_config

__all__ = ["save_hf", "load_hf", "load_model", "init_checkpoint", "quantize_checkpoint", "SaveResult",
           "CheckpointFormatError", "meta_model", "materialize",
           "INDEX_NAME", "CONFIG_NAME", "shard_name", "plan_shards", "read_index", "checkpoint_target",
           "DEFAULT_MAX_SHARD_BYTES", "check_manifest", "check_new_destination"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the HF default ("5GB")


class CheckpointFormatError(ValueError):
    """A checkpoint whose files do not match the public layout of its config."""


@dataclass
class SaveResult:
    path: Path
    target: str
    shards: list[str]
    num_keys: int
    total_size: int  # tensor bytes, as the index's metadata.total_size


def shard_name(i: int, n: int) -> str:
    """1-based shard ``i`` of ``n``, named like the release."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def plan_shards(layout: Layout, max_shard_bytes: int) -> list[list[Entry]]:
    """Greedy, in layout order: a shard closes when the next entry would push it past the bound.
    An entry (an MXFP4 pair included) is never split; one larger than the bound gets its own shard."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[Entry]] = [[]]
    size = 0
    for ent in layout.entries:
        n = ent.nbytes()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(ent)
        size += n
    return shards


def _codec():
    try:
        from k3core.ops import mxfp4
    except ImportError as e:  # pragma: no cover - the codec ships with k3core
        raise ImportError("k3core.ops.mxfp4 (the MXFP4 codec) is needed for mxfp4 checkpoints") from e
    return mxfp4


def _export(ent: Entry, native: torch.Tensor) -> list[torch.Tensor]:
    """The stored tensor(s) of one entry, in ``ent.stored()`` order."""
    if ent.codec == "mxfp4":
        packed, scale = _codec().quantize(ent.native_view(native).detach(), name=ent.public)
        return [packed, scale]
    return [ent.to_public(native)]


def _native_state(model_or_state_dict, layout: Layout) -> Mapping[str, torch.Tensor]:
    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    missing = [k for k in layout.native if k not in state]
    unexpected = [k for k in state if k not in layout.native]
    if missing or unexpected:
        raise CheckpointFormatError(f"state dict does not match the config: missing {missing[:5]}"
                                    f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                                    f"{' ...' if len(unexpected) > 5 else ''}")
    for k, shape in layout.native.items():
        if tuple(state[k].shape) != shape:
            raise CheckpointFormatError(f"{k}: shape {list(state[k].shape)}, the config implies {list(shape)}")
    return state


def save_hf(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], path: str | os.PathLike,
            config: K3Config | None = None, target: str = "bf16",
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra_files: Mapping[str, Path] | None = None) -> SaveResult:
    """Write a native K3 model (or its state dict) to ``path`` in the public layout.

    ``target="bf16"``: every tensor in its public dtype (bf16, fp32 for the tensors the release keeps
    fp32). ``target="mxfp4"``: routed experts as MXFP4 pairs (``k3core.ops.mxfp4.quantize``), and
    ``config.json`` declares ``quantization_config``. ``path`` is replaced as a whole (files in it that
    are not checkpoint files, e.g. a tokenizer, are kept); see the module docstring for crash safety.
    ``extra_files``: name -> file copied into the checkpoint with it (a tokenizer), in its manifest.
    """
    if config is None:
        config = getattr(model_or_state_dict, "config", None)
        if not isinstance(config, K3Config):
            raise ValueError("save_hf needs config= when given a state dict")
    layout = public_layout(config, target)
    state = _native_state(model_or_state_dict, layout)
    return _write_checkpoint(path, layout, max_shard_bytes, lambda ent: _export(ent, state[ent.native]), extra_files)


def _write_checkpoint(path: str | os.PathLike, layout: Layout, max_shard_bytes: int,
                      produce: Callable[[Entry], list[torch.Tensor]],
                      extra_files: Mapping[str, Path] | None = None) -> SaveResult:
    """Plan shards, stream every entry's stored tensors (``produce``) into them, then config, then the
    index, in a staging directory published over ``path`` in one step."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    plan = plan_shards(layout, max_shard_bytes)
    n = len(plan)
    remove_stale_staging(path)
    staging = staging_dir_for(path)
    weight_map: dict[str, str] = {}
    known: dict[str, tuple[str, int]] = {}  # shard -> (sha256, bytes), hashed as written
    total = 0
    try:
        for i, entries in enumerate(plan, 1):
            name = shard_name(i, n)
            stored = [s for ent in entries for s in ent.stored()]

            def stream(entries=entries) -> Iterator[tuple[str, torch.Tensor]]:
                for ent in entries:
                    for (key, _, _), t in zip(ent.stored(), produce(ent)):
                        yield key, t

            nbytes, digest = write_safetensors_hashed(staging / name, stored, stream())
            known[name] = (digest, nbytes)
            for key, shape, dtype in stored:
                weight_map[key] = name
                total += torch.Size(shape).numel() * dtype.itemsize
        qc = mxfp4_quantization_config() if layout.target == "mxfp4" else None
        layout.config.replace(quantization_config=qc).to_json_file(staging / CONFIG_NAME)
        atomic_write_json(staging / INDEX_NAME, {"metadata": {"total_size": total},
                                                 "weight_map": dict(sorted(weight_map.items()))})
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, staging / name)
        write_manifest(staging, known=known)  # the shards are not read back; the small files are hashed
        publish_dir(staging, path, keep=_not_checkpoint_file)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return SaveResult(path, layout.target, [shard_name(i, n) for i in range(1, n + 1)], len(weight_map), total)


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> SaveResult:
    """A bf16 public checkpoint -> the same checkpoint with MXFP4 routed experts, streamed tensor by
    tensor (never the whole model in memory). Byte-identical to ``save_hf(load_hf(src), dst,
    target="mxfp4")``: the public bf16 expert tensor is exactly the native view it came from.

    ``dst`` must be a new or empty directory, apart from ``src``: quantising over the source would
    replace the bf16 weights with their lossy MXFP4 version, and over another checkpoint would
    destroy it (``ValueError`` naming the fix)."""
    from safetensors import safe_open

    src = Path(src)
    if not (src / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{src} is not a checkpoint directory (no {CONFIG_NAME}): give the bf16 checkpoint's "
                                "directory (config.json, index, shards) as SRC")
    check_new_destination(src, dst, "quantize")
    config = K3Config.from_json_file(src / CONFIG_NAME)
    if checkpoint_target(config) != "bf16":
        raise ValueError(f"{src} is already quantised ({config.quantization_config.get('format')}); quantize reads bf16 checkpoints")
    source = public_layout(config, "bf16")
    weight_map = read_index(src)
    check_keys(source, weight_map)
    check_manifest(src, weight_map)
    handles: dict[str, object] = {}

    def read(key: str, shape, dtype) -> torch.Tensor:
        shard = weight_map[key]
        if shard not in handles:
            handles[shard] = safe_open(str(src / shard), framework="pt", device="cpu")
        t = handles[shard].get_tensor(key)
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise CheckpointFormatError(f"{key!r} in {shard}: {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
        return t

    def produce(ent: Entry) -> list[torch.Tensor]:
        t = read(ent.public, ent.shape, ent.dtype)
        return list(_codec().quantize(t, name=ent.public)) if ent.codec == "mxfp4" else [t]

    return _write_checkpoint(dst, public_layout(config, "mxfp4"), max_shard_bytes, produce)


def check_new_destination(src: str | os.PathLike, dst: str | os.PathLike, what: str) -> None:
    """Refuse ``dst`` when it is ``src``, lies inside it or holds it, or is a non-empty directory."""
    s, d = Path(src).resolve(), Path(dst).resolve()
    if d == s or s in d.parents or d in s.parents:
        raise ValueError(f"{what}: destination {dst} is the source {src} or overlaps it: write into a new directory")
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ValueError(f"{what}: destination {dst} exists and is not an empty directory: refusing to replace it; "
                         f"choose a new directory, or remove {dst} first")


def _not_checkpoint_file(name: str) -> bool:
    """Files of an older version of ``path`` that ``save_hf`` does not own (kept across a save)."""
    return not (name in (INDEX_NAME, CONFIG_NAME, MANIFEST_NAME, "model.safetensors")
                or (name.startswith("model-") and name.endswith(".safetensors")))


# ---------------------------------------------------------------------------------------------- load
def read_index(path: str | os.PathLike) -> dict[str, str]:
    """weight_map of ``path/model.safetensors.index.json`` (key -> shard file name)."""
    p = Path(path) / INDEX_NAME
    try:
        with open(p) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise CheckpointFormatError(f"{p} not found: not a complete checkpoint (the index is written last)") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{p}: not valid JSON ({e})") from e
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointFormatError(f"{p}: no 'weight_map' object of key -> shard file")
    for shard in set(wm.values()):
        if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise CheckpointFormatError(f"{p}: shard name {shard!r} is not a plain file name")
    return wm


def check_manifest(path: str | os.PathLike, weight_map: dict[str, str]) -> dict | None:
    """Verify the checkpoint's manifest when it has one (a release fetched from elsewhere has none;
    a pin holds it to a hash): every listed file, and config, index and every shard the index names
    must be listed. ``ManifestError`` (a ``ValueError``) names the first file that differs."""
    return verify_manifest(path, must_list={CONFIG_NAME, INDEX_NAME, *weight_map.values()})


def checkpoint_target(config: K3Config) -> str:
    """The target format a checkpoint's config.json declares."""
    return "bf16" if config.quantization_config is None else "mxfp4"


def check_keys(layout: Layout, keys) -> list[str]:
    """Out-of-scope keys (vision tower); raises on a missing or an unexpected text key."""
    expected = layout.by_key
    keys = set(keys)
    out_of_scope = sorted(k for k in keys if is_out_of_scope(k))
    missing = [k for k in expected if k not in keys]
    unexpected = sorted(k for k in keys if k not in expected and not is_out_of_scope(k))
    if missing:
        raise CheckpointFormatError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all) for the "
                                    f"{layout.target} layout of this config")
    if unexpected:
        raise CheckpointFormatError(f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all) "
                                    f"for the {layout.target} layout of this config")
    return out_of_scope


def _decode(ent: Entry, stored: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if ent.codec == "mxfp4":
        packed, scale = stored
        return _codec().dequantize(packed, scale, dtype)
    return ent.narrow_public(stored[0])


@torch.no_grad()
def load_hf(path: str | os.PathLike, config: K3Config | None = None, model: nn.Module | None = None,
            device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Read the public checkpoint at ``path`` into native tensors.

    With ``model`` (materialised, not on the meta device): every parameter and persistent buffer is
    overwritten in place (values converted to the parameter's dtype and device) and the model is
    returned. Without: a native state dict is returned, on ``device``, fp32 tensors fp32 and the rest
    in ``dtype`` (default: the file's bf16). ``config`` defaults to the checkpoint's ``config.json``;
    the format (bf16 or MXFP4) is always the checkpoint's own. MXFP4 pairs are dequantised.
    Every stored tensor's shape and dtype are checked against the layout before it is read.
    """
    from safetensors import safe_open

    path = Path(path)
    ckpt_cfg = K3Config.from_json_file(path / CONFIG_NAME)
    config = config or ckpt_cfg
    layout = public_layout(config, checkpoint_target(ckpt_cfg))
    weight_map = read_index(path)
    check_keys(layout, weight_map)
    check_manifest(path, weight_map)
    if model is not None:
        state = _native_state(model, layout)
        for k, t in state.items():
            if t.device.type == "meta":
                raise ValueError(f"model tensor {k} is on the meta device: materialise it first (k3core.checkpoint.names.materialize)")
    else:
        state = {k: torch.empty(s, device=device,
                                dtype=public_dtype(k) if dtype is None or public_dtype(k) == torch.float32 else dtype)
                 for k, s in layout.native.items()}
    by_shard: dict[str, list[Entry]] = defaultdict(list)
    for ent in layout.entries:
        shards = {weight_map[k] for k, _, _ in ent.stored()}
        if len(shards) != 1:
            raise CheckpointFormatError(f"{ent.public}: weight_packed and weight_scale are in different shards {sorted(shards)}")
        by_shard[shards.pop()].append(ent)
    for shard, entries in by_shard.items():
        fp = path / shard
        if not fp.is_file():
            raise CheckpointFormatError(f"{fp}: shard named by the index is missing")
        try:
            handle = safe_open(str(fp), framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointFormatError(f"{fp}: not a readable safetensors file ({e})") from e
        with handle as f:
            present = set(f.keys())
            for ent in entries:
                stored = []
                for key, shape, dt in ent.stored():
                    if key not in present:
                        raise CheckpointFormatError(f"{key!r}: the index says {shard}, which does not hold it")
                    sl = f.get_slice(key)
                    got_dt, got_shape = ST_TO_DTYPE.get(sl.get_dtype()), tuple(sl.get_shape())
                    if got_dt != dt or got_shape != shape:
                        raise CheckpointFormatError(f"{key!r} in {shard}: {sl.get_dtype()} {list(got_shape)}, expected "
                                                    f"{dt} {list(shape)} ({layout.target} layout of this config)")
                    stored.append(f.get_tensor(key))
                view = ent.native_view(state[ent.native])
                view.copy_(_decode(ent, stored, view.dtype))
    if model is not None:
        if getattr(model, "use_inference_caches", False) and hasattr(model, "refresh_inference_caches"):
            model.refresh_inference_caches()  # weights changed: AttnRes w*gamma must follow
        return model
    return state


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.bfloat16, config: K3Config | None = None):
    """A ``K3ForCausalLM`` built on the meta device, materialised on ``device`` in ``dtype`` (fp32
    where the release keeps fp32) and filled from ``path``: no throwaway initialisation."""
    config = config or K3Config.from_json_file(Path(path) / CONFIG_NAME)
    model = meta_model(config)
    materialize(model, device)
    model.cast(dtype)
    return load_hf(path, config=config, model=model)


def init_checkpoint(preset_or_config: str | K3Config, out_dir: str | os.PathLike, seed: int = 0,
                    format: str = "bf16", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    tokenizer: str | os.PathLike = "bytes") -> SaveResult:
    """A fresh random model (``K3ForCausalLM.reset_parameters(seed)``) saved in the public layout
    (``format`` "bf16" or "mxfp4"). Same preset and seed -> the same bytes.

    ``tokenizer``: "bytes" (no tokenizer files: the byte vocabulary of the CPU presets), "bpe" (the
    bundled K3-layout BPE, ``k3core.tokenizer.BUNDLED_K3_BPE``) or a directory holding a tokenizer
    in the release's layout or as ``tokenizer.json``. Its data files are copied into the checkpoint
    (never a ``tokenization_*.py``), and the config's vocabulary and bos/eos/pad become the
    tokenizer's."""
    config = K3Config.preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    config = config.replace(quantization_config=None)
    extra: dict[str, Path] = {}
    if str(tokenizer) != "bytes":
        config, extra = _with_tokenizer(config, tokenizer)
    model = meta_model(config)
    materialize(model, "cpu")
    model.reset_parameters(seed)
    model.cast(torch.bfloat16)
    return save_hf(model, out_dir, config, target=format, max_shard_bytes=max_shard_bytes, extra_files=extra)


TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def tokenizer_files(directory: str | os.PathLike) -> dict[str, Path]:
    """The tokenizer data files ``directory`` holds (of ``TOKENIZER_FILES``), by name: what a checkpoint
    written from a model loaded out of ``directory`` copies (``save_hf(extra_files=...)``)."""
    directory = Path(directory)
    return {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}


def _with_tokenizer(config: K3Config, tokenizer: str | os.PathLike) -> tuple[K3Config, dict[str, Path]]:
    """``config`` sized for ``tokenizer`` ("bpe" or a directory), and the data files to copy."""
    from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer

    directory = BUNDLED_K3_BPE if str(tokenizer) == "bpe" else Path(tokenizer)
    if not directory.is_dir():
        raise ValueError(f"--tokenizer {tokenizer}: not 'bytes', 'bpe' or a directory holding a tokenizer")
    tok = load_tokenizer(directory)
    if tok.eos_id is None or tok.pad_id is None:
        raise ValueError(f"the tokenizer in {directory} names no eos or pad token (tokenizer_config.json's eos_token, "
                         "pad_token): the model needs both")
    config = config.replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                            bos_token_id=tok.bos_id if tok.bos_id is not None else tok.eos_id)
    return config, tokenizer_files(directory)
