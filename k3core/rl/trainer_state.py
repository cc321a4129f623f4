"""The trainer state: optimizer (``StreamedAdamW``: fp32 master weights and moments), the model's
buffers, RNG states and run metadata, saved and loaded with torch.distributed.checkpoint (DCP) as
one directory.

The weights are stored once, as the optimizer's fp32 masters. The device weights are those masters
rounded to the model's dtype (``StreamedAdamW`` keeps them so after every step), so a load rebuilds
them by the same rounding, bit for bit; storing them beside the masters would add 2 B/param (bf16)
to the 8 B/param of optimizer state for nothing. A state written before this layout (``model.*``
entries for every parameter) still loads: its masters are read and its weight copies ignored."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from k3core.checkpoint.manifest import write_manifest
from k3core.config import K3Config
from k3core.model import K3ForCausalLM


def make_optimizer(model: K3ForCausalLM, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The trainer's optimizer: ``StreamedAdamW``, fp32 master weights and stochastically rounded bf16
    moments on the host (8 B/param), updated chunk by chunk with no host gradient buffer. Gradient
    clipping stays in the train step (``clip_grad_norm_``)."""
    from k3core.optim.streamed_adam import StreamedAdamW

    params = [p for p in model.parameters() if p.requires_grad]
    return StreamedAdamW(params, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)


QAT_KEY = "qat_routed_experts"


def set_qat(model: K3ForCausalLM, on: bool) -> K3ForCausalLM:
    """Switch MXFP4 QAT of the routed experts (``K3Config.qat_routed_experts``: fake-quantised forward,
    straight-through gradient) on a built model: its config (validated: expert widths must be
    multiples of 32) and every routed-expert stack. Names, shapes and weights do not change."""
    from k3core.model.moe import RoutedExperts

    model.config = model.config.replace(qat_routed_experts=bool(on))
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            m.qat = bool(on)
    return model


WEIGHTS_KEY = "weights"
WEIGHTS_FROM_MASTERS = "optimizer masters"  # extra[WEIGHTS_KEY]: the layout of this module's docstring


def _without_masters(msd: dict, osd: dict) -> dict:
    """The model state dict less the parameters whose fp32 master the optimizer state holds."""
    return {k: v for k, v in msd.items() if k not in osd["state"]}


def save_trainer_state(out_dir: str | Path, model: K3ForCausalLM, optimizer: torch.optim.Optimizer,
                       extra: dict, storage_writer_factory=None, rng: tuple | None = None) -> None:
    """DCP save of the optimizer, the model's entries the optimizer does not hold (buffers, frozen
    parameters), RNG states and ``extra`` (iteration, data cursor, ...) into ``out_dir`` (the caller
    publishes the directory atomically), plus ``config.json``. Whether the model trains with QAT
    goes into ``extra`` (``qat_routed_experts``), since config.json describes the model in public
    names only and has no place for a training switch. ``rng``: the (torch, Python) RNG states to
    save (``rng_state()`` when the trainer was left; default: this process's now).

    Reads ``model`` and ``optimizer`` only, and touches no global state, so it may run in a thread
    beside stages that read them too (a rollout); the caller keeps an update from changing them
    until it returns.

    Every file is hashed as it is written (``ODirectFileSystemWriter.digests``; the default writer is
    that pipeline without O_DIRECT), and the manifest takes those digests: nothing is read back. A
    ``storage_writer_factory`` whose writer reports no digests gets its files hashed from disk."""
    from k3core.artifacts import remember_digests
    from k3core.checkpoint.odirect import ODirectFileSystemWriter

    out_dir = Path(out_dir)
    extra = {**extra, QAT_KEY: bool(model.config.qat_routed_experts), WEIGHTS_KEY: WEIGHTS_FROM_MASTERS}
    msd, osd = get_state_dict(model, optimizer)
    torch_rng, python_rng = rng if rng is not None else rng_state()
    state = {"model": _without_masters(msd, osd), "optim": osd,
             "rng": {"torch": torch_rng, "python": json.dumps(python_rng)}, "extra": json.dumps(extra)}
    factory = storage_writer_factory or (lambda path: ODirectFileSystemWriter(path, direct=False))
    writer = factory(out_dir)
    dcp.save(state, checkpoint_id=str(out_dir), storage_writer=writer)
    known = dict(getattr(writer, "digests", None) or {})
    distributed = torch.distributed.is_initialized()
    if distributed:  # FSDP2: every rank wrote its own data files
        parts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, known)
        known = {k: v for part in parts for k, v in part.items()}
    if not distributed or torch.distributed.get_rank() == 0:
        model.config.to_json_file(out_dir / "config.json")
        (out_dir / "extra.json").write_text(json.dumps(extra, indent=2))
        # last: sha256 of every file (all ranks' data, .metadata included), checked before any load
        manifest = write_manifest(out_dir, known=known)
        remember_digests(out_dir, {n: e["sha256"] for n, e in manifest["files"].items()})


def load_trainer_state(path: str | Path, lr: float, dtype: torch.dtype = torch.float32, shard=None,
                       device: str | torch.device = "cpu"):
    """(model, optimizer, extra) from a trainer-state directory written by ``save_trainer_state``;
    the model trains with QAT when the state was saved with it (``extra['qat_routed_experts']``).
    The model's weights are materialised on ``device`` and DCP reads them straight into it; the
    optimizer (``StreamedAdamW``) keeps its state (master weights, moments) on the host whatever the
    device, and is built after the model is placed, so its streams pair host state with device weights.

    Nothing is read before the directory's manifest checks out (every file's size and sha256;
    ``ManifestError`` names the first that differs). ``.metadata`` is then unpickled from the
    verified bytes with an allowlist, and non-tensor items with ``weights_only`` (``dcp_safe``).
    ``shard``: applied to the model on the meta device before it gets storage (FSDP2,
    ``k3core.rl.fsdp.shard_model``); each rank then reads its shards. DCP reshards on load, so a
    state saved by any number of ranks loads into any other."""
    from k3core.checkpoint.dcp_safe import METADATA_NAME, safe_dcp_load
    from k3core.checkpoint.hf import meta_model
    from k3core.checkpoint.manifest import verify_manifest

    path = Path(path)
    manifest = verify_manifest(path, required=True, must_list=(METADATA_NAME, "config.json", "extra.json"))
    config = K3Config.from_json_file(path / "config.json")
    model = meta_model(config)
    if shard is None:
        model.to_empty(device=device)
        model.cast(dtype)
    else:
        model.cast(dtype)
        shard(model)
        model.to_empty(device=device)
    opt = make_optimizer(model, lr)
    msd, osd = get_state_dict(model, opt)
    state = {"model": _without_masters(msd, osd), "optim": osd, "rng": {"torch": torch.get_rng_state(), "python": ""},
             "extra": ""}
    safe_dcp_load(state, path, manifest=manifest)
    # the optimizer's load sets every weight it holds from its master (rounded to the weight's dtype)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    torch.set_rng_state(state["rng"]["torch"])
    py = json.loads(state["rng"]["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    extra = json.loads(state["extra"])
    set_qat(model, extra.get(QAT_KEY, False))
    return model, opt, extra


def load_trainer_model(path: str | Path, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> K3ForCausalLM:
    """The model alone from a trainer-state directory, no optimizer built: what a rollout engine,
    an evaluation or an export needs from a trainer state. DCP reads the model's buffers and the
    fp32 master of every trainable parameter (at most ``_MASTER_READ_BYTES`` of masters at a time
    beside the model), rounded into the model's dtype as the trainer does. The manifest is checked
    first, as in ``load_trainer_state``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from k3core.checkpoint.dcp_safe import METADATA_NAME, safe_dcp_load, verified_dcp_reader
    from k3core.checkpoint.hf import meta_model
    from k3core.checkpoint.manifest import verify_manifest

    path = Path(path)
    manifest = verify_manifest(path, required=True, must_list=(METADATA_NAME, "config.json", "extra.json"))
    model = meta_model(K3Config.from_json_file(path / "config.json"))
    model.to_empty(device=device)
    model.cast(dtype)
    msd = get_model_state_dict(model)
    saved = verified_dcp_reader(path, manifest=manifest).read_metadata().state_dict_metadata
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    masters = {n for n in trainable if f"optim.state.{n}.master" in saved}
    safe_dcp_load({"model": {k: v for k, v in msd.items() if k not in masters}}, path, manifest=manifest)
    with torch.no_grad():
        for group in _groups(sorted(masters), lambda n: 4 * msd[n].numel(), _MASTER_READ_BYTES):
            fp32 = {n: torch.empty(msd[n].shape, dtype=torch.float32) for n in group}
            safe_dcp_load({"optim": {"state": {n: {"master": t} for n, t in fp32.items()}}}, path, manifest=manifest)
            for n, t in fp32.items():
                msd[n].copy_(t)  # round to nearest into the weight's dtype, as StreamedAdamW does
    set_model_state_dict(model, msd)
    set_qat(model, json.loads((path / "extra.json").read_text()).get(QAT_KEY, False))
    return model


_MASTER_READ_BYTES = 256 << 20  # fp32 masters read into host memory at once by load_trainer_model


def _groups(names: list[str], nbytes, limit: int) -> list[list[str]]:
    """``names`` cut in order into groups of at most ``limit`` bytes (a larger item alone)."""
    out, size = [[]], 0
    for n in names:
        if out[-1] and size + nbytes(n) > limit:
            out.append([])
            size = 0
        out[-1].append(n)
        size += nbytes(n)
    return [g for g in out if g]


def rng_state() -> tuple:
    """The process's torch and Python RNG states (what a trainer state saves)."""
    return torch.get_rng_state(), random.getstate()


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])


# DCP warns on every save and load without a process group that it assumes a single process. That
# is this trainer's case (one process; FSDP runs under torchrun with a group). The filter is set
# once, for that message only: a `warnings.catch_warnings()` block per call is not thread-safe, and
# a trainer state is saved in a thread beside the next rollout.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)
