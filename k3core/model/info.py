"""Parameter counts and bytes of a K3 config, computed on the meta device (never hard-coded).

``model_info(config)`` builds ``K3ForCausalLM`` on the meta device (no memory) and counts:
total parameters, parameters active per token (everything but the routed experts a token does not
use), routed-expert parameters active per token, and bytes in bf16 (fp32 where the release keeps
fp32) and with MXFP4 routed experts (4-bit elements + one uint8 scale per 32 = 4.25 bits each).
"""

from __future__ import annotations

import torch

from k3core.config import K3Config


def model_info(config: K3Config) -> dict:
    from k3core.model.k3 import FP32_NAME_SUFFIXES, K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config, init_weights=False)
    total = routed = fp32 = 0
    per_kind: dict[str, int] = {}
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".experts.w" in name:
            routed += n
        if name.endswith(FP32_NAME_SUFFIXES):
            fp32 += n
        kind = ("routed_experts" if ".experts.w" in name else "shared_experts" if "shared_experts" in name
                else "embeddings" if "embed_tokens" in name or name.startswith("lm_head") else
                "moe_router_latent" if "block_sparse_moe" in name else "dense_mlp" if ".mlp." in name
                else "mla" if ("self_attn" in name and model.model.layers[int(name.split(".")[2])].is_mla)
                else "kda" if "self_attn" in name else "norms_attnres")
        per_kind[kind] = per_kind.get(kind, 0) + n
    routed_active = routed * config.num_experts_per_token // config.num_experts
    active = total - routed + routed_active
    bf16_bytes = (total - fp32) * 2 + fp32 * 4
    mxfp4_routed_bytes = routed // 2 + routed // 32
    return {
        "total_params": total,
        "active_params": active,
        "routed_params": routed,
        "routed_active_params": routed_active,
        "routed_active_fraction": routed_active / active,
        "fp32_params": fp32,
        "bytes_bf16": bf16_bytes,
        "bytes_mxfp4_routed": bf16_bytes - routed * 2 + mxfp4_routed_bytes,
        "params_by_kind": per_kind,
        "layers": {"total": config.num_hidden_layers,
                   "kda": sum(config.layer_type(i) == "kda" for i in range(config.num_hidden_layers)),
                   "mla": sum(config.layer_type(i) == "mla" for i in range(config.num_hidden_layers)),
                   "moe": len(config.moe_layers), "attn_res_blocks": config.num_attn_res_blocks},
    }


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def format_model_info(name: str, info: dict) -> str:
    L = info["layers"]
    rows = [
        f"K3 model '{name}': {L['total']} layers ({L['kda']} KDA, {L['mla']} MLA, {L['moe']} MoE), "
        f"{L['attn_res_blocks']} AttnRes blocks",
        f"  total parameters          {_fmt(info['total_params']):>10}  ({info['total_params']:,})",
        f"  active per token          {_fmt(info['active_params']):>10}  ({info['active_params']:,})",
        f"  routed-expert active      {_fmt(info['routed_active_params']):>10}  "
        f"({100 * info['routed_active_fraction']:.1f}% of active)",
        f"  bytes, bf16               {_fmt(info['bytes_bf16']):>10}B",
        f"  bytes, MXFP4 routed       {_fmt(info['bytes_mxfp4_routed']):>10}B",
        "  parameters by kind:",
    ]
    for k, v in sorted(info["params_by_kind"].items(), key=lambda kv: -kv[1]):
        rows.append(f"    {k:<22}{_fmt(v):>10}")
    return "\n".join(rows)
