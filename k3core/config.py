"""K3Config: the Kimi K3 text backbone's configuration, validated once, at the edge.

Owns: every field of the public release (``text_config`` of ``moonshotai/Kimi-K3``) with the release
values as defaults, the named presets (``tiny``, ``small``, ``medium``, ``full``), and reading and
writing Hugging Face ``config.json`` (outer ``kimi_k3`` with an inner ``kimi_linear`` text config,
1-based layer lists under ``linear_attn_config``, the MXFP4 ``quantization_config``).

Does not own: parameter counting (``k3core.model.info``), checkpoint names (``k3core.checkpoint``).

Layer indices in this module's methods are 0-based; the 1-based lists of the public config live
only in ``full_attn_layers``/``kda_layers`` (as in the file) and are converted here, once.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["K3Config", "mxfp4_quantization_config", "PRESETS"]

OUTER_MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"


def mxfp4_quantization_config() -> dict[str, Any]:
    """The release's MXFP4 declaration (compressed-tensors ``mxfp4-pack-quantized``): only routed
    experts are quantised; everything listed in ``ignore`` stays bf16/fp32."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",  # serving engines (SGLang's K3) read it per group
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "group_size": 32,
                    "symmetric": True,
                    "dynamic": False,
                    "strategy": "group",
                    "scale_dtype": "torch.uint8",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
    }


def _release_full_attn_layers(num_layers: int) -> list[int]:
    """1-based MLA layers of the release schedule: every 4th layer, plus the last one."""
    layers = list(range(4, num_layers + 1, 4))
    if num_layers not in layers:
        layers.append(num_layers)
    return layers


@dataclass
class K3Config:
    """Kimi K3 text backbone. Defaults are the public release (2.8T total, ~104B active)."""

    # trunk
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839
    initializer_range: float = 0.02
    # layer schedule (1-based, as in linear_attn_config); None = the release rule for this depth
    full_attn_layers: list[int] | None = None
    kda_layers: list[int] | None = None
    # KDA (linear_attn_config)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_short_conv_kernel_size: int = 4
    kda_gate_lower_bound: float = -5.0
    kda_use_full_rank_gate: bool = True
    # gated NoPE MLA
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # dense MLP
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792
    # latent MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    num_expert_group: int = 1
    topk_group: int = 1
    use_routed_expert_norm: bool = True
    # activation
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # Block Attention Residuals
    attn_res_block_size: int = 12
    # checkpoint format: None (bf16) or the MXFP4 declaration
    quantization_config: dict[str, Any] | None = None
    # Training-time switch, not part of the model: routed-expert weights pass through the MXFP4
    # round trip in the forward (straight-through gradient), so the trainer sees the weights an
    # MXFP4 engine runs. A runtime flag: config.json has no place for it (it describes the model,
    # not how it is trained), so it is neither written nor read there.
    qat_routed_experts: bool = False
    # keys of the outer config.json we do not interpret (vision_config, ...), kept for write-back
    extra_outer: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.full_attn_layers is None and self.kda_layers is None:
            if isinstance(self.num_hidden_layers, int) and self.num_hidden_layers > 0:
                self.full_attn_layers = _release_full_attn_layers(self.num_hidden_layers)
                fa = set(self.full_attn_layers)
                self.kda_layers = [i for i in range(1, self.num_hidden_layers + 1) if i not in fa]
        elif self.kda_layers is None and self.full_attn_layers is not None:
            fa = set(self.full_attn_layers)
            self.kda_layers = [i for i in range(1, self.num_hidden_layers + 1) if i not in fa]
        elif self.full_attn_layers is None and self.kda_layers is not None:
            kd = set(self.kda_layers)
            self.full_attn_layers = [i for i in range(1, self.num_hidden_layers + 1) if i not in kd]
        self.validate()

    # ------------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        """Every problem with this configuration (empty when valid)."""
        p: list[str] = []
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim",
            "kda_short_conv_kernel_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "v_head_dim", "intermediate_size", "num_experts",
            "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
            "attn_res_block_size", "num_expert_group", "topk_group",
        ]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                p.append(f"{name} must be a positive integer, got {v!r}")
        for name in ["qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace"]:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                p.append(f"{name} must be a non-negative integer, got {v!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and 0 < self.rms_norm_eps < 1):
            p.append(f"rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if not (isinstance(self.kda_gate_lower_bound, (int, float)) and self.kda_gate_lower_bound < 0):
            p.append(f"kda_gate_lower_bound must be negative (gates live in [lower_bound, 0)), got {self.kda_gate_lower_bound!r}")
        if not isinstance(self.qat_routed_experts, bool):
            p.append(f"qat_routed_experts must be true or false, got {self.qat_routed_experts!r}")
        elif self.qat_routed_experts:
            for name in ("moe_intermediate_size", "routed_expert_hidden_size"):
                v = getattr(self, name)
                if isinstance(v, int) and v % 32:
                    p.append(f"{name} ({v}) must be a multiple of 32 for MXFP4 QAT of routed experts (blocks of 32)")
        if self.hidden_act != "situ":
            p.append(f"hidden_act must be 'situ' (K3 uses SiTU-GLU everywhere), got {self.hidden_act!r}")
        for name in ["activation_situ_beta", "activation_situ_linear_beta", "routed_scaling_factor"]:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                p.append(f"{name} must be a positive number, got {v!r}")
        if self.moe_router_activation_func != "sigmoid":
            p.append(f"moe_router_activation_func must be 'sigmoid', got {self.moe_router_activation_func!r}")
        if self.topk_method != "noaux_tc":
            p.append(f"topk_method must be 'noaux_tc', got {self.topk_method!r}")
        if not self.mla_use_nope:
            p.append("mla_use_nope must be true: K3's MLA applies no rotary embedding")
        ints_ok = all(isinstance(getattr(self, n), int) and getattr(self, n) > 0
                      for n in ["num_experts", "num_experts_per_token", "num_expert_group", "topk_group", "num_hidden_layers"])
        if ints_ok:
            if self.num_experts_per_token > self.num_experts:
                p.append(f"num_experts_per_token ({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})")
            if self.num_experts % self.num_expert_group:
                p.append(f"num_expert_group ({self.num_expert_group}) must divide num_experts ({self.num_experts})")
            if self.topk_group > self.num_expert_group:
                p.append(f"topk_group ({self.topk_group}) exceeds num_expert_group ({self.num_expert_group})")
            elif self.num_experts % self.num_expert_group == 0 and self.num_expert_group > 1:
                per_group = self.num_experts // self.num_expert_group
                if self.topk_group * per_group < self.num_experts_per_token:
                    p.append(f"topk_group x experts per group ({self.topk_group} x {per_group}) is fewer than "
                             f"num_experts_per_token ({self.num_experts_per_token})")
            if isinstance(self.first_k_dense_replace, int) and self.first_k_dense_replace > self.num_hidden_layers:
                p.append(f"first_k_dense_replace ({self.first_k_dense_replace}) exceeds num_hidden_layers ({self.num_hidden_layers})")
            L = self.num_hidden_layers
            fa, kd = self.full_attn_layers or [], self.kda_layers or []
            bad = [i for i in list(fa) + list(kd) if not isinstance(i, int) or not 1 <= i <= L]
            if bad:
                p.append(f"full_attn_layers/kda_layers are 1-based and must lie in [1, {L}]; got {bad[:5]}")
            both = sorted(set(fa) & set(kd))
            if both:
                p.append(f"layers {both[:5]} are listed both in full_attn_layers and kda_layers")
            missing = sorted(set(range(1, L + 1)) - set(fa) - set(kd))
            if missing:
                p.append(f"layers {missing[:5]} are in neither full_attn_layers nor kda_layers (1-based)")
            if len(set(fa)) != len(fa) or len(set(kd)) != len(kd):
                p.append("full_attn_layers/kda_layers contain duplicates")
        for name in ["bos_token_id", "eos_token_id", "pad_token_id"]:
            v = getattr(self, name)
            if isinstance(self.vocab_size, int) and not (isinstance(v, int) and 0 <= v < self.vocab_size):
                p.append(f"{name} ({v!r}) must lie in [0, vocab_size={self.vocab_size})")
        if self.quantization_config is not None and self.quantization_config != mxfp4_quantization_config():
            qc = self.quantization_config
            if not (isinstance(qc, dict) and qc.get("format") == "mxfp4-pack-quantized"
                    and qc.get("quant_method") == "compressed-tensors"):
                p.append("quantization_config must be the release's compressed-tensors mxfp4-pack-quantized "
                         "declaration (see k3core.config.mxfp4_quantization_config()) or absent")
        if self.quantization_config is not None:
            for name in ("moe_intermediate_size", "routed_expert_hidden_size"):
                v = getattr(self, name)
                if isinstance(v, int) and v % 32:
                    p.append(f"{name} ({v}) must be a multiple of 32 for MXFP4 routed experts (blocks of 32)")
        return p

    def validate(self) -> None:
        """Raise one ValueError listing every problem."""
        problems = self.problems()
        if problems:
            lines = "\n".join(f"  - {x}" for x in problems)
            raise ValueError(f"invalid K3Config ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n{lines}")

    # ------------------------------------------------------------------ derived
    def layer_type(self, layer: int) -> str:
        """'mla' or 'kda' for a 0-based layer index."""
        return "mla" if (layer + 1) in set(self.full_attn_layers) else "kda"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The shared experts act as one SiTU-GLU MLP of this width."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_attn_res_blocks(self) -> int:
        """Snapshots appended to the AttnRes block list (the embedding output is the first)."""
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    @property
    def kda_a_log_public_size(self) -> int:
        """Public checkpoints store ``A_log`` zero-padded to this length (128 for 96 heads in the
        release): the next multiple of 64 at or above ``kda_num_heads``."""
        return -(-self.kda_num_heads // 64) * 64

    def replace(self, **changes: Any) -> K3Config:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if "num_hidden_layers" in changes and "full_attn_layers" not in changes and "kda_layers" not in changes:
            d["full_attn_layers"] = d["kda_layers"] = None
        d.update(changes)
        return K3Config(**d)

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str) -> K3Config:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**copy.deepcopy(PRESETS[name]))

    # ------------------------------------------------------------------ Hugging Face config.json
    def to_hf_dict(self) -> dict[str, Any]:
        """The outer ``kimi_k3`` config with the text backbone under ``text_config``."""
        text = {
            "model_type": TEXT_MODEL_TYPE,
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": self.mla_use_nope,
            "mla_use_output_gate": self.mla_use_output_gate,
            "first_k_dense_replace": self.first_k_dense_replace,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "moe_router_activation_func": self.moe_router_activation_func,
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "topk_method": self.topk_method,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "latent_moe_use_norm": self.use_routed_expert_norm,
            "hidden_act": self.hidden_act,
            "activation_situ_beta": self.activation_situ_beta,
            "activation_situ_linear_beta": self.activation_situ_linear_beta,
            "attn_res_block_size": self.attn_res_block_size,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.kda_short_conv_kernel_size,
                "gate_lower_bound": self.kda_gate_lower_bound,
                "use_full_rank_gate": self.kda_use_full_rank_gate,
                "full_attn_layers": list(self.full_attn_layers),
                "kda_layers": list(self.kda_layers),
            },
        }
        text.update(WEIGHTS_DTYPE)
        if self.quantization_config is not None:
            text["quantization_config"] = copy.deepcopy(self.quantization_config)
        outer = {
            "model_type": OUTER_MODEL_TYPE,
            "architectures": ["KimiK3ForConditionalGeneration"],
            **WEIGHTS_DTYPE,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            **copy.deepcopy(self.extra_outer),
            "text_config": text,
        }
        return outer

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> K3Config:
        """Read an outer ``kimi_k3`` config (or a bare ``kimi_linear`` text config). Any other
        model type is refused; vision settings are kept for write-back but never used."""
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        extra_outer: dict[str, Any] = {}
        if mt == OUTER_MODEL_TYPE:
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("config.json of model_type 'kimi_k3' has no 'text_config' object: "
                                 "is this a complete Kimi K3 config?")
            skip = {"model_type", "architectures", "text_config", "bos_token_id", "eos_token_id", "pad_token_id",
                    *WEIGHTS_DTYPE}
            extra_outer = {k: v for k, v in d.items() if k not in skip}
        elif mt == TEXT_MODEL_TYPE:
            text = d
        else:
            raise ValueError(f"unsupported model_type {mt!r}: k3rl reads Kimi K3 configs (outer model_type "
                             f"'{OUTER_MODEL_TYPE}' with a '{TEXT_MODEL_TYPE}' text_config) only")
        if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
            raise ValueError(f"text_config.model_type must be '{TEXT_MODEL_TYPE}', got {text.get('model_type')!r}")
        _refuse_unsupported(text)
        lac = text.get("linear_attn_config") or {}
        kw: dict[str, Any] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for k, v in text.items():
            if k in names and k not in ("quantization_config", "extra_outer", "full_attn_layers", "kda_layers",
                                        "qat_routed_experts"):
                kw[k] = v
        for public, native in [("num_heads", "kda_num_heads"), ("head_dim", "kda_head_dim"),
                               ("short_conv_kernel_size", "kda_short_conv_kernel_size"),
                               ("gate_lower_bound", "kda_gate_lower_bound"),
                               ("use_full_rank_gate", "kda_use_full_rank_gate"),
                               ("full_attn_layers", "full_attn_layers"), ("kda_layers", "kda_layers")]:
            if public in lac:
                kw[native] = lac[public]
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if name not in kw and name in d:
                kw[name] = d[name]
            if isinstance(kw.get(name), list):  # HF allows a list of eos ids; K3 has one
                kw[name] = kw[name][0]
        kw["use_routed_expert_norm"] = _routed_expert_norm(text)
        kw["quantization_config"] = text.get("quantization_config")
        kw["extra_outer"] = extra_outer
        return cls(**kw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> K3Config:
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); re-download or regenerate the config") from e
        return cls.from_hf_dict(d)

    def to_json_file(self, path: str | os.PathLike) -> None:
        """Write config.json atomically (temporary name, fsync, rename)."""
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_hf_dict(), f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


# The dtype of the stored non-expert weights, declared in both configs: without it SGLang's
# ``--dtype auto`` picks float16 for the model.
WEIGHTS_DTYPE = {"torch_dtype": "bfloat16", "dtype": "bfloat16"}

# Keys of Kimi/DeepSeek-style configs that change the computation, with the only value k3rl computes.
# A config that sets one of them otherwise is refused rather than silently computed differently.
_FIXED_KEYS: dict[str, Any] = {"moe_layer_freq": 1, "rope_scaling": None, "sliding_window": None,
                               "attention_bias": False, "mlp_bias": False}


def _refuse_unsupported(text: dict[str, Any]) -> None:
    bad = [f"{k}={text[k]!r} (k3rl computes {v!r} only)" for k, v in _FIXED_KEYS.items()
           if k in text and text[k] != v]
    if bad:
        raise ValueError("config.json sets what k3rl's model does not compute: " + "; ".join(bad)
                         + ". Loading it would run a different model; remove or fix these keys if they are wrong.")


def _routed_expert_norm(text: dict[str, Any]) -> bool:
    """The latent-MoE norm switch: ``latent_moe_use_norm`` (the release's and SGLang's name), or the
    older ``use_routed_expert_norm``; both given and different is refused."""
    new, old = text.get("latent_moe_use_norm"), text.get("use_routed_expert_norm")
    if new is not None and old is not None and bool(new) != bool(old):
        raise ValueError(f"config.json sets latent_moe_use_norm={new!r} and use_routed_expert_norm={old!r}: "
                         "they name one switch; keep latent_moe_use_norm")
    if new is None and old is None:
        raise ValueError("config.json has no latent_moe_use_norm: the latent-MoE norm switch must be stated "
                         "(serving engines default it to false)")
    return bool(new if new is not None else old)


# Byte-level vocabulary for the CPU presets: 256 byte values, then the special tokens.
_BYTE_VOCAB = dict(vocab_size=260, bos_token_id=256, eos_token_id=257, pad_token_id=258)

PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: dense layer 0, MoE layers 1-3, KDA layers 1-3, MLA layer 4 (1-based), 2 AttnRes blocks.
    "tiny": dict(
        **_BYTE_VOCAB, hidden_size=64, num_hidden_layers=4, max_position_embeddings=4096,
        kda_num_heads=2, kda_head_dim=16,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16,
        intermediate_size=128, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        moe_intermediate_size=32, routed_expert_hidden_size=64, attn_res_block_size=2,
    ),
    # The CPU RL demo: byte-level vocabulary, 8 layers (3:1 KDA:MLA), 2 AttnRes blocks.
    "small": dict(
        **_BYTE_VOCAB, hidden_size=256, num_hidden_layers=8, max_position_embeddings=8192,
        kda_num_heads=4, kda_head_dim=64,
        num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32,
        intermediate_size=768, num_experts=16, num_experts_per_token=4, num_shared_experts=1,
        moe_intermediate_size=256, routed_expert_hidden_size=192, attn_res_block_size=4,
    ),
    # One H200 with host-offloaded Adam: ~2B parameters, 3:1 KDA:MLA, 4 AttnRes blocks, 64 experts.
    "medium": dict(
        vocab_size=163840, hidden_size=1536, num_hidden_layers=24, max_position_embeddings=131072,
        kda_num_heads=12, kda_head_dim=128,
        num_attention_heads=12, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64,
        intermediate_size=6144, num_experts=64, num_experts_per_token=8, num_shared_experts=2,
        moe_intermediate_size=384, routed_expert_hidden_size=768, attn_res_block_size=6,
    ),
    # The smallest preset SGLang's K3 serves correctly: its AttnRes aggregation kernel walks the hidden
    # dimension in blocks of 1024 (SGLANG_ATTN_RES_BLOCK_H), so hidden_size must be a multiple of it.
    # Byte-level vocabulary (no tokenizer: k3rl and `--skip-tokenizer-init` speak token ids).
    "serve-small": dict(
        **_BYTE_VOCAB, hidden_size=1024, num_hidden_layers=8, max_position_embeddings=8192,
        kda_num_heads=8, kda_head_dim=128,
        num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64,
        intermediate_size=2816, num_experts=16, num_experts_per_token=4, num_shared_experts=1,
        moe_intermediate_size=256, routed_expert_hidden_size=512, attn_res_block_size=4,
    ),
    "full": dict(),
}

# SGLang's AttnRes aggregation (``sglang/srt/layers/attn_residual.py``, ``_BLOCK_H``) reads the hidden
# dimension in blocks of this many elements; a hidden size that is not a multiple is computed wrongly.
SGLANG_ATTN_RES_BLOCK_H = 1024
