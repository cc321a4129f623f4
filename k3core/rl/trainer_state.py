"""The trainer state: model, optimizer (``StreamedAdamW``), RNG states and run metadata, saved and
loaded with torch.distributed.checkpoint (DCP) as one directory."""

from __future__ import annotations

import contextlib
import json
import random
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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


def save_trainer_state(out_dir: str | Path, model: K3ForCausalLM, optimizer: torch.optim.Optimizer,
                       extra: dict, storage_writer_factory=None) -> None:
    """DCP save of model, optimizer, RNG states and ``extra`` (iteration, data cursor, ...) into
    ``out_dir`` (the caller publishes the directory atomically), plus ``config.json``. Whether the
    model trains with QAT goes into ``extra`` (``qat_routed_experts``), since config.json describes
    the model in public names only and has no place for a training switch."""
    out_dir = Path(out_dir)
    extra = {**extra, QAT_KEY: bool(model.config.qat_routed_experts)}
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd,
             "rng": {"torch": torch.get_rng_state(), "python": json.dumps(random.getstate())},
             "extra": json.dumps(extra)}
    writer = storage_writer_factory(out_dir) if storage_writer_factory else None
    with _single_process_dcp():
        dcp.save(state, checkpoint_id=str(out_dir), storage_writer=writer)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:  # FSDP2: every rank saved its shards
        model.config.to_json_file(out_dir / "config.json")
        (out_dir / "extra.json").write_text(json.dumps(extra, indent=2))
        write_manifest(out_dir)  # last: sha256 of every file (all ranks' data, .metadata included), checked before any load


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
    state = {"model": msd, "optim": osd, "rng": {"torch": torch.get_rng_state(), "python": ""}, "extra": ""}
    with _single_process_dcp():
        safe_dcp_load(state, path, manifest=manifest)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"]["torch"])
    py = json.loads(state["rng"]["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    extra = json.loads(state["extra"])
    set_qat(model, extra.get(QAT_KEY, False))
    return model, opt, extra


def load_trainer_model(path: str | Path, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> K3ForCausalLM:
    """The model alone from a trainer-state directory (DCP reads only the model's entries; no
    optimizer is built): what a rollout engine needs from a trainer state. The manifest is checked
    first, as in ``load_trainer_state``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from k3core.checkpoint.dcp_safe import METADATA_NAME, safe_dcp_load
    from k3core.checkpoint.hf import meta_model
    from k3core.checkpoint.manifest import verify_manifest

    path = Path(path)
    manifest = verify_manifest(path, required=True, must_list=(METADATA_NAME, "config.json", "extra.json"))
    model = meta_model(K3Config.from_json_file(path / "config.json"))
    model.to_empty(device=device)
    model.cast(dtype)
    state = {"model": get_model_state_dict(model)}
    with _single_process_dcp():
        safe_dcp_load(state, path, manifest=manifest)
    set_model_state_dict(model, state["model"])
    set_qat(model, json.loads((path / "extra.json").read_text()).get(QAT_KEY, False))
    return model


def rng_state() -> tuple:
    """The process's torch and Python RNG states (what a trainer state saves)."""
    return torch.get_rng_state(), random.getstate()


def set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])


@contextlib.contextmanager
def _single_process_dcp():
    """DCP warns on every save and load without a process group that it assumes a single process.
    That is this trainer's case (one process; FSDP runs under torchrun with a group), so the
    warning is silenced here and nowhere else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield
