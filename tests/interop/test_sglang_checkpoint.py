"""k3rl's exported checkpoints held against SGLang's own Kimi K3 code (the oracle, not a copy of it).

- config.json of every preset, bf16 and MXFP4, is read by SGLang's ``ModelConfig`` (its config registry
  maps ``kimi_k3`` to its ``KimiK3Config``) and every field k3rl's model computes with comes out with
  k3rl's value; SGLang's resolved dtype is bfloat16 and its quantization compressed-tensors for MXFP4.
- Every tensor of a checkpoint written by ``init_checkpoint`` goes through SGLang's
  ``KimiK3ForConditionalGeneration.load_weights`` one at a time: each one lands in a parameter of
  SGLang's model (none dropped) and afterwards no parameter of the text model is left unwritten (every
  parameter starts as NaN, or 0xFF for packed MXFP4 bytes, and none keeps it).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import sglang_cpu
from k3core.checkpoint.hf import init_checkpoint
from k3core.config import PRESETS, K3Config, mxfp4_quantization_config

# Every KimiLinearConfig attribute SGLang's K3 reads to build the model, with k3rl's source of the value.
# (SGLang name, k3rl K3Config attribute or a function of it)
RELIED_ON = [
    ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("num_hidden_layers", "num_hidden_layers"),
    ("rms_norm_eps", "rms_norm_eps"), ("tie_word_embeddings", "tie_word_embeddings"),
    ("num_attention_heads", "num_attention_heads"), ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"), ("mla_use_nope", "mla_use_nope"),
    ("mla_use_output_gate", "mla_use_output_gate"), ("first_k_dense_replace", "first_k_dense_replace"),
    ("intermediate_size", "intermediate_size"), ("num_experts", "num_experts"),
    ("num_experts_per_token", "num_experts_per_token"), ("num_experts_per_tok", "num_experts_per_token"),
    ("num_shared_experts", "num_shared_experts"), ("moe_intermediate_size", "moe_intermediate_size"),
    ("routed_expert_hidden_size", "routed_expert_hidden_size"),
    ("moe_router_activation_func", "moe_router_activation_func"), ("moe_renormalize", "moe_renormalize"),
    ("routed_scaling_factor", "routed_scaling_factor"), ("topk_method", "topk_method"),
    ("num_expert_group", "num_expert_group"), ("topk_group", "topk_group"),
    ("latent_moe_use_norm", "use_routed_expert_norm"), ("hidden_act", "hidden_act"),
    ("activation_situ_beta", "activation_situ_beta"),
    ("activation_situ_linear_beta", "activation_situ_linear_beta"),
    ("attn_res_block_size", "attn_res_block_size"), ("max_position_embeddings", "max_position_embeddings"),
    ("moe_layer_freq", lambda c: 1),
    ("linear_layer_ids", lambda c: [i - 1 for i in c.kda_layers]),
    ("full_attention_layer_ids", lambda c: [i - 1 for i in c.full_attn_layers]),
    ("is_moe", lambda c: True), ("is_mla", lambda c: True), ("is_linear_attn", lambda c: True),
]
LINEAR_ATTN = [("num_heads", "kda_num_heads"), ("head_dim", "kda_head_dim"),
               ("short_conv_kernel_size", "kda_short_conv_kernel_size"),
               ("use_full_rank_gate", "kda_use_full_rank_gate"), ("gate_lower_bound", "kda_gate_lower_bound")]


def _k3rl_value(cfg: K3Config, source):
    return source(cfg) if callable(source) else getattr(cfg, source)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_config_json_reads_into_sglang_with_k3rl_values(preset, fmt, tmp_path):
    cfg = K3Config.preset(preset)
    if fmt == "mxfp4":
        cfg = cfg.replace(quantization_config=mxfp4_quantization_config())
    cfg.to_json_file(tmp_path / "config.json")
    mc = sglang_cpu.model_config(str(tmp_path))
    from sglang.srt.configs.kimi_k3 import KimiK3Config
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    assert type(mc.hf_config) is KimiK3Config and type(mc.hf_text_config) is KimiLinearConfig
    text = mc.hf_text_config
    wrong = {name: (getattr(text, name), _k3rl_value(cfg, src)) for name, src in RELIED_ON
             if getattr(text, name) != _k3rl_value(cfg, src)}
    wrong.update({f"linear_attn_config.{k}": (text.linear_attn_config.get(k), getattr(cfg, src))
                  for k, src in LINEAR_ATTN if text.linear_attn_config.get(k) != getattr(cfg, src)})
    # transformers fills an absent rope_scaling with the unscaled "default" type: the same rotary embedding
    if (text.rope_scaling or {}).get("rope_type", "default") != "default":
        wrong["rope_scaling"] = (text.rope_scaling, None)
    assert not wrong, f"SGLang reads {preset}/{fmt} differently (SGLang value, k3rl value): {wrong}"
    assert mc.dtype == torch.bfloat16, "SGLang --dtype auto must resolve to the checkpoint's bfloat16"
    if fmt == "mxfp4":
        assert mc.quantization == "compressed-tensors"
        groups = mc.hf_config.quantization_config["config_groups"]
        assert {g["format"] for g in groups.values()} == {"mxfp4-pack-quantized"}
    else:
        assert mc.quantization is None


def _load_one_at_a_time(model, tensors: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """Run SGLang's ``load_weights`` on each checkpoint tensor alone; map each name to the SGLang
    parameters its call reports loaded. ``post_load_weights`` (fusions for CUDA kernels) runs once after."""
    inner = model.language_model
    real_load, real_post = type(inner).load_weights, type(inner).post_load_weights
    reported: list[set[str]] = []
    inner.load_weights = lambda weights: reported.append(real_load(inner, weights)) or reported[-1]
    inner.post_load_weights = lambda: None
    out = {}
    try:
        for name, t in tensors.items():
            model.load_weights([(name, t)])
            out[name] = reported[-1]
    finally:
        del inner.load_weights, inner.post_load_weights
    assert real_post is type(inner).post_load_weights
    return out


_SENTINEL_U8 = 0xFF  # never a stored E8M0 scale (0xFF is NaN in E8M0); a row of packed FP4 all 0xFF is not random


def _unwritten(param: torch.Tensor, rows: int | None) -> bool:
    p = param.detach() if rows is None else param.detach()[:rows]
    if p.dtype == torch.uint8:
        return bool((p.reshape(*p.shape[:-1], -1) == _SENTINEL_U8).all(-1).any())
    return bool(torch.isnan(p.float()).any())


@pytest.mark.parametrize("preset,fmt", [("tiny", "bf16"), ("tiny", "mxfp4"), ("small", "bf16"),
                                        ("serve-small", "mxfp4")])
def test_every_tensor_loads_into_sglang_none_dropped_none_unwritten(preset, fmt, tmp_path):
    init_checkpoint(preset, tmp_path, format=fmt)
    tensors = {}
    for shard in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"] \
        if (tmp_path / "model.safetensors.index.json").exists() else None
    assert index is None or set(index) == set(tensors)

    model, mc = sglang_cpu.build_sglang_k3(str(tmp_path))
    params = {f"language_model.{n}": p for n, p in model.language_model.named_parameters()}
    zero_init = {n for n in params if n.endswith(("w13_weight_bias", "w2_weight_bias"))}
    for n in zero_init:  # MXFP4 MoE methods allocate expert biases the K3 release does not have
        assert not params[n].detach().any(), f"SGLang initialises {n} nonzero: a bias-free checkpoint would not zero it"
    with torch.no_grad():
        for n, p in params.items():
            if n not in zero_init:
                p.fill_(_SENTINEL_U8 if p.dtype == torch.uint8 else float("nan"))

    landed = _load_one_at_a_time(model, tensors)
    inner_names = {n.removeprefix("language_model.") for n in params}
    dropped = sorted(n for n, got in landed.items() if not got or not got <= inner_names)
    assert not dropped, f"SGLang's load_weights dropped {len(dropped)} k3rl tensors, e.g. {dropped[:5]}"

    vocab = mc.hf_text_config.vocab_size  # SGLang pads the vocabulary; the padding rows have no weights
    padded = {"language_model.model.embed_tokens.weight", "language_model.lm_head.weight"}
    unwritten = sorted(n for n, p in params.items()
                       if n not in zero_init and _unwritten(p, vocab if n in padded else None))
    assert not unwritten, f"SGLang parameters no k3rl tensor wrote: {unwritten}"
    assert bool(zero_init) == (fmt == "mxfp4")


def test_the_check_sees_a_dropped_tensor(tmp_path):
    """The old key name: SGLang reads latent_moe_use_norm false, builds no routed_expert_norm and its
    loader skips that tensor without a word. The one-at-a-time load reports exactly those tensors."""
    init_checkpoint("tiny", tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["text_config"]["latent_moe_use_norm"] = False
    (tmp_path / "config.json").write_text(json.dumps(d))
    tensors = {}
    for shard in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    model, _ = sglang_cpu.build_sglang_k3(str(tmp_path))
    landed = _load_one_at_a_time(model, tensors)
    dropped = sorted(n for n, got in landed.items() if not got)
    assert dropped and all(n.endswith("routed_expert_norm.weight") for n in dropped)
