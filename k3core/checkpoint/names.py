"""The one mapping between native K3 parameter names and the public (Hugging Face) checkpoint layout.

Owns: for any ``K3Config`` and target format (``"bf16"`` or ``"mxfp4"``), the ordered list of public
entries, each saying which public key(s) it is stored under, with which shape and dtype, and which
part of which native tensor it is. Everything else in ``k3core.checkpoint`` (writer, reader,
validator, expected key sets) derives from this list; there is no second list of names.

Does not own: file I/O (``hf.py``), the MXFP4 codec (``k3core.ops.mxfp4``).

The native tensors are enumerated from ``K3ForCausalLM(config)`` built on the meta device (so the
model's own ``state_dict`` is the source of truth); the public side follows these rules:

==========================================================  =============================================
native (``K3ForCausalLM.state_dict()``)                     public (``language_model.`` + ...)
==========================================================  =============================================
``model.X`` (everything not below)                          ``model.X`` (same shape)
``lm_head.weight``                                          ``lm_head.weight``
``...mlp.gate_up_proj.weight`` ``[2I, D]``                  ``...mlp.gate_proj.weight`` rows ``[:I]``,
(dense layer 0 and ``block_sparse_moe.shared_experts.``)    ``...mlp.up_proj.weight`` rows ``[I:]``
``...experts.w13`` ``[E, 2I, Dl]``                          ``...experts.{e}.w1.weight`` (gate) ``[I, Dl]``,
                                                            ``...experts.{e}.w3.weight`` (up) ``[I, Dl]``
``...experts.w2`` ``[E, Dl, I]``                            ``...experts.{e}.w2.weight`` ``[Dl, I]``
``...self_attn.A_log`` ``[H]``                              ``...self_attn.A_log`` ``[kda_a_log_public_size]``
                                                            (zero-padded on export; narrowed on import,
                                                            nonzero padding refused)
==========================================================  =============================================

With ``target="mxfp4"`` each routed-expert weight ``experts.{e}.wX.weight`` ``[out, in]`` is stored as
the pair ``experts.{e}.wX.weight_packed`` (uint8 ``[out, in/2]``) and ``experts.{e}.wX.weight_scale``
(uint8 ``[out, in/32]``), which must share a shard. Public dtypes: fp32 for ``A_log``, ``dt_bias``,
the short convolutions, ``o_norm`` and the router's ``e_score_correction_bias``; bf16 for the rest.
Vision-tower keys of a real release (``vision_tower.``, ``mm_projector.``) are out of scope.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from k3core.config import K3Config
from k3core.model.k3 import FP32_NAME_SUFFIXES, K3ForCausalLM
from k3core.ops.mxfp4 import BLOCK as MXFP4_BLOCK  # elements along the input dim sharing one E8M0 scale

__all__ = [
    "PUBLIC_PREFIX", "OUT_OF_SCOPE_PREFIXES", "TARGETS", "MXFP4_BLOCK", "Entry", "Layout",
    "native_shapes", "native_to_public", "public_layout", "is_out_of_scope", "public_dtype",
    "mxfp4_stored_shapes", "meta_model", "materialize",
]

PUBLIC_PREFIX = "language_model."
OUT_OF_SCOPE_PREFIXES = ("vision_tower.", "mm_projector.", "language_model.vision_tower.",
                         "language_model.mm_projector.")
TARGETS = ("bf16", "mxfp4")

# Kept fp32 in public files whatever the model dtype: the same suffixes the model keeps fp32.
FP32_SUFFIXES = FP32_NAME_SUFFIXES

_FUSED_GATE_UP = ".gate_up_proj.weight"
_W13, _W2 = "block_sparse_moe.experts.w13", "block_sparse_moe.experts.w2"


def is_out_of_scope(key: str) -> bool:
    """True for tensors of a real release the text backbone does not own (vision tower, projector)."""
    return key.startswith(OUT_OF_SCOPE_PREFIXES)


def public_dtype(native_name: str) -> torch.dtype:
    return torch.float32 if native_name.endswith(FP32_SUFFIXES) else torch.bfloat16


def mxfp4_stored_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(packed, scale) shapes of an MXFP4 pair for a logical ``[out, in]`` weight: two FP4 codes per
    byte and one uint8 E8M0 scale per 32 inputs. ``in`` must be a multiple of 32 (as in the release);
    anything else is refused here, before a byte is written."""
    out, inp = shape
    if inp % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {MXFP4_BLOCK}; a routed-expert "
                         f"weight of shape {list(shape)} cannot be stored as mxfp4 (choose routed_expert_hidden_size "
                         f"and moe_intermediate_size as multiples of {MXFP4_BLOCK}, or target bf16)")
    return (out, inp // 2), (out, inp // MXFP4_BLOCK)


@dataclass(frozen=True)
class Entry:
    """One logical public tensor and the native sub-tensor it is.

    ``native[expert]`` (when ``expert`` is set), then rows ``[rows[0]:rows[1]]`` (when set), is the
    native view; ``shape`` is the public logical shape (the view's shape, except ``codec="pad"``
    where dim 0 is the padded public length). ``codec``: ``"plain"`` (same values), ``"pad"``
    (zero-pad dim 0), ``"mxfp4"`` (stored as a ``weight_packed``/``weight_scale`` pair).
    """

    public: str
    native: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    codec: str = "plain"
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def stored(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """[(key, shape, dtype)] as they appear in the safetensors files (two keys for MXFP4)."""
        if self.codec != "mxfp4":
            return [(self.public, self.shape, self.dtype)]
        packed, scale = mxfp4_stored_shapes(self.shape)
        base = self.public[: -len(".weight")]
        return [(base + ".weight_packed", packed, torch.uint8), (base + ".weight_scale", scale, torch.uint8)]

    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for _, s, d in self.stored())

    def native_view(self, native: torch.Tensor) -> torch.Tensor:
        """The part of the native tensor this entry is (a view: writes go to the native tensor)."""
        t = native if self.expert is None else native[self.expert]
        return t if self.rows is None else t[self.rows[0]: self.rows[1]]

    def to_public(self, native: torch.Tensor) -> torch.Tensor:
        """Native tensor -> the public logical tensor (public dtype, contiguous, CPU), unquantised."""
        v = self.native_view(native).detach()
        if self.codec == "pad":
            out = torch.zeros(self.shape, dtype=self.dtype)
            out[: v.shape[0]] = v.to("cpu", self.dtype)
            return out
        return v.to("cpu", self.dtype).contiguous()

    def narrow_public(self, t: torch.Tensor) -> torch.Tensor:
        """Public logical tensor -> the values of the native view (refuses nonzero ``A_log`` padding)."""
        if self.codec != "pad":
            return t
        n = self.rows[1] - self.rows[0]
        pad = t[n:]
        # bitwise: -0.0 or a NaN in the padding would not survive a byte-exact re-export either
        if pad.numel() and bool(pad.contiguous().view(torch.int32).ne(0).any()):
            raise ValueError(f"{self.public}: padding entries [{n}:{t.shape[0]}] must be +0.0 (the model has {n} heads), "
                             f"found {pad.tolist()[:8]}: the file does not match this config's kda_num_heads")
        return t[:n]


class _SkipRandomInitOnMeta(TorchFunctionMode):
    """Random fills of meta tensors are no-ops anyway, but torch computes them through its Python
    reference kernels, whose first use imports for ~10 s; skip them (thread-local, unlike patching
    ``torch.nn.init``)."""

    _SKIP = {torch.Tensor.normal_, torch.Tensor.uniform_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._SKIP or getattr(func, "__module__", None) == "torch.nn.init":
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def meta_model(config: K3Config) -> K3ForCausalLM:
    """``K3ForCausalLM(config)`` on the meta device (no storage, no initialisation): the source of
    native names and shapes; ``to_empty(device=...)`` materialises it for loading."""
    with torch.device("meta"), _SkipRandomInitOnMeta():
        return K3ForCausalLM(config, init_weights=False)


def materialize(model: torch.nn.Module, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Give every meta parameter and buffer uninitialised storage on ``device`` (in place). Same
    result as ``model.to_empty(device=...)`` for a model without shared tensors, without the slow
    first call of torch's Python ``empty_like`` reference for meta inputs."""
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                mod._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                           requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return model


@functools.lru_cache(maxsize=16)
def _native_shapes_cached(config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    model = meta_model(K3Config.from_hf_dict(json.loads(config_json)))
    return tuple((k, tuple(v.shape)) for k, v in model.state_dict().items())


def _config_key(config: K3Config) -> str:
    d = config.to_hf_dict()
    d["text_config"].pop("quantization_config", None)  # the format does not change native shapes
    return json.dumps(d, sort_keys=True)


def native_shapes(config: K3Config) -> dict[str, tuple[int, ...]]:
    """Every native state-dict key (parameters and persistent buffers) -> shape, in model order."""
    return dict(_native_shapes_cached(_config_key(config)))


def native_to_public(name: str, shape: tuple[int, ...], config: K3Config, target: str = "bf16") -> list[Entry]:
    """The public entries of one native tensor (the mapping rule; see the module docstring)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if not (name.startswith("model.") or name == "lm_head.weight"):
        raise ValueError(f"{name!r} is not a K3 text-backbone tensor (native names start with 'model.' or are 'lm_head.weight')")
    public = PUBLIC_PREFIX + name
    dtype = public_dtype(name)
    if name.endswith(_FUSED_GATE_UP):
        I = shape[0] // 2
        stem = public[: -len(_FUSED_GATE_UP)]
        rest = tuple(shape[1:])
        return [Entry(stem + ".gate_proj.weight", name, (I, *rest), dtype, rows=(0, I)),
                Entry(stem + ".up_proj.weight", name, (I, *rest), dtype, rows=(I, 2 * I))]
    codec = "mxfp4" if target == "mxfp4" else "plain"
    if name.endswith(_W13):
        E, I2, Dl = shape
        I = I2 // 2
        stem = public[: -len("w13")]
        out = []
        for e in range(E):
            out.append(Entry(f"{stem}{e}.w1.weight", name, (I, Dl), dtype, codec, expert=e, rows=(0, I)))
            out.append(Entry(f"{stem}{e}.w3.weight", name, (I, Dl), dtype, codec, expert=e, rows=(I, I2)))
        return out
    if name.endswith(_W2):
        E, Dl, I = shape
        stem = public[: -len("w2")]
        return [Entry(f"{stem}{e}.w2.weight", name, (Dl, I), dtype, codec, expert=e) for e in range(E)]
    if name.endswith("self_attn.A_log"):
        (H,) = shape
        padded = config.kda_a_log_public_size
        if padded < H:
            raise ValueError(f"kda_a_log_public_size {padded} is smaller than kda_num_heads {H}")
        return [Entry(public, name, (padded,), dtype, "pad", rows=(0, H))]
    return [Entry(public, name, tuple(shape), dtype)]


@dataclass
class Layout:
    """The public layout of one config and target: ordered entries (release-like order: decoder layers
    first, then embeddings, final norm, output AttnRes and ``lm_head``) and lookups."""

    config: K3Config
    target: str
    entries: list[Entry]
    native: dict[str, tuple[int, ...]]

    def __post_init__(self) -> None:
        self.by_key: dict[str, tuple[Entry, int]] = {}
        for ent in self.entries:
            for j, (key, _, _) in enumerate(ent.stored()):
                if key in self.by_key:
                    raise AssertionError(f"two entries store {key!r}")
                self.by_key[key] = (ent, j)

    def stored_keys(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every key the safetensors files must hold -> (shape, dtype)."""
        return {k: (s, d) for ent in self.entries for k, s, d in ent.stored()}

    def total_bytes(self) -> int:
        return sum(e.nbytes() for e in self.entries)


def public_layout(config: K3Config, target: str = "bf16") -> Layout:
    """The public layout for ``config`` and ``target``, derived from the model's native tensors."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    shapes = native_shapes(config)
    layers, trunk = [], []
    for name, shape in shapes.items():
        (layers if name.startswith("model.layers.") else trunk).extend(native_to_public(name, shape, config, target))
    return Layout(config, target, layers + trunk, shapes)
