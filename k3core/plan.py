"""The planner: what a K3 config costs on a cluster, on paper, from the config alone.

Owns: hardware descriptions (built-in ``h200`` and ``b300`` nodes, user JSON/YAML files), the
parallel layout (TP, EP, PP, CP, DP, FSDP) and its validation, and pure functions that turn
(config, hardware, tokens per GPU, layout) into bytes and seconds:

- parameter-shaped bytes per GPU and per node (bf16 weights and gradients on the GPU; fp32
  master, two bf16 moments and, without the streamed optimizer, an fp32 gradient buffer on the host);
- context-shaped bytes per GPU by layer type (KDA, MLA, latent MoE, SiTU-GLU naive vs streaming,
  AttnRes and norms, routing, logits), with and without per-layer activation checkpointing;
- GPUs per training replica with and without the two streaming optimisations (SiTU-GLU that saves
  only its input; host Adam streamed in chunks, without the fp32 gradient buffer);
- the rollout engine's footprint in bf16 and with MXFP4 routed experts, and the nodes it needs;
- checkpoint sizes and save times at a filesystem bandwidth;
- pipeline stage layouts aligned to Attention Residual blocks, their utilisation and the bytes a
  stage boundary carries.

Does not own: parameter counting (``k3core.model.info.model_info`` builds the model on the meta
device; this module only distributes its per-kind counts over layers), measurement
(``benchmarks/plan_calibration.py`` checks the estimates on a GPU), the CLI (``flows/cli_plan.py``).

Units: bytes (``int``/``float``) everywhere inside; GB = 1e9 bytes in printed tables.

"Tokens per GPU" ``T`` is the number of tokens whose hidden states a GPU holds in one micro-batch,
after the context-parallel split and the tensor-parallel (sequence-parallel) split: a TP x CP group
serves a micro-batch of ``T * TP * CP`` tokens. With that definition nearly every activation a GPU
keeps is ``T`` times a per-token size that does not depend on TP (head-sharded tensors hold all the
group's tokens for ``H / TP`` heads), and a GPU's routed experts receive ``R = T * k`` (token,
expert) rows under balanced routing. Per-token sizes follow the k3core implementation op by op
(see ``layer_activation_terms``); every term is an estimate until the GPU calibration
(docs/planner.md, "What is unvalidated").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable

from k3core.config import K3Config

__all__ = [
    "GB", "Hardware", "HARDWARE", "load_hardware", "Layout", "Kernels", "ParamCounts", "param_counts",
    "host_adam_bytes_per_param", "gpu_bytes_per_param", "situ_glu_saved_bytes", "layer_activation_terms",
    "layer_backward_workspace", "snapshots_before", "boundary_bytes", "aligned_stage_layout",
    "check_stage_layout", "StageLayout", "stage_layout", "context_table", "stage_memory", "replica_size",
    "replica_sweep", "max_tokens_per_gpu", "engine_footprint", "checkpoint_report", "plan", "format_plan",
    "static_decode_state_bytes", "device_ledger",
]

GB = 1e9
MiB = 2**20
BF16, FP32, INT64 = 2, 4, 8
# Optimizer state on the host, bytes per parameter (published RL stack, reproduced here):
MASTER_FP32, MOMENTS_BF16, HOST_GRAD_FP32 = 4, 2 + 2, 4
# On the GPU: bf16 weights and bf16 gradients (reduce-scattered to the owning shard).
GPU_WEIGHT_BF16, GPU_GRAD_BF16 = 2, 2
# A training checkpoint: bf16 model 2 + master 4 + moments 4 = 10 bytes/param (the published ~28 TB).


# =====================================================================================  hardware
@dataclass(frozen=True)
class Hardware:
    """One node type. Bandwidths in GB/s (1e9 bytes/s); memory in bytes.

    ``hbm_bytes`` per GPU, ``host_ram_bytes`` per node; ``nvlink_gbps`` per GPU (all links, both
    directions, as marketed); ``pcie_gbps`` host<->GPU per GPU, one direction; ``network_gbps`` per
    node (all NICs, one direction); ``filesystem_gbps`` sustained write of the shared filesystem
    for one job. ``hbm_reserve_bytes`` per GPU is never available to tensors (CUDA context, NCCL
    buffers, allocator fragmentation); ``host_reserve_bytes`` per node likewise (OS, pinned staging,
    data loading).
    """

    name: str
    gpus_per_node: int
    hbm_bytes: float
    host_ram_bytes: float
    nvlink_gbps: float
    pcie_gbps: float
    network_gbps: float
    filesystem_gbps: float
    hbm_reserve_bytes: float = 8 * GB
    host_reserve_bytes: float = 100 * GB
    notes: str = ""

    def problems(self) -> list[str]:
        p = []
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node <= 0:
            p.append(f"gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        for f in ("hbm_bytes", "host_ram_bytes", "nvlink_gbps", "pcie_gbps", "network_gbps", "filesystem_gbps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                p.append(f"{f} must be a positive number, got {v!r}")
        for f in ("hbm_reserve_bytes", "host_reserve_bytes"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                p.append(f"{f} must be a non-negative number, got {v!r}")
        if not p and self.hbm_reserve_bytes >= self.hbm_bytes:
            p.append("hbm_reserve_bytes leaves no HBM for tensors")
        if not p and self.host_reserve_bytes >= self.host_ram_bytes:
            p.append("host_reserve_bytes leaves no host RAM")
        return p

    @property
    def hbm_usable(self) -> float:
        return self.hbm_bytes - self.hbm_reserve_bytes

    @property
    def host_usable(self) -> float:
        return self.host_ram_bytes - self.host_reserve_bytes


HARDWARE: dict[str, Hardware] = {
    "h200": Hardware(
        name="h200", gpus_per_node=8,
        hbm_bytes=143771 * MiB,  # measured (nvidia-smi); marketed "141 GB"; sources: docs/planner.md
        host_ram_bytes=2e12, nvlink_gbps=900.0, pcie_gbps=55.0, network_gbps=8 * 400 / 8,
        filesystem_gbps=5.5,
        notes="8 x H200 (143771 MiB HBM each, measured; marketed 141 GB), 2 TB host RAM, NVLink 4 "
              "900 GB/s per GPU, PCIe 55 GB/s per GPU (measured, pinned), 8 x 400 Gb/s network, "
              "shared filesystem 5.5 GB/s (assumed: the published 5-6 GB/s)",
    ),
    "b300": Hardware(
        name="b300", gpus_per_node=8,
        hbm_bytes=288e9,  # marketed 288 GB, taken as 288e9 bytes (assumption: not measured)
        host_ram_bytes=2e12, nvlink_gbps=1800.0, pcie_gbps=55.0, network_gbps=8 * 800 / 8,
        filesystem_gbps=5.5,
        notes="8 x B300 (288 GB HBM3e each as marketed, assumed 288e9 bytes), 2 TB host RAM "
              "(DGX B300), NVLink 5 1800 GB/s per GPU, PCIe 55 GB/s per GPU (assumed equal to the "
              "H200 measurement: Gen5 host CPUs), 8 x 800 Gb/s network, shared filesystem 5.5 GB/s "
              "(assumed)",
    ),
}

_HW_GB_FIELDS = {"hbm_gb": "hbm_bytes", "host_ram_gb": "host_ram_bytes",
                 "hbm_reserve_gb": "hbm_reserve_bytes", "host_reserve_gb": "host_reserve_bytes"}


def _yaml_available() -> bool:
    try:
        import yaml  # noqa: F401
    except ImportError:
        return False
    return True


def load_hardware(spec: str | os.PathLike | Hardware) -> Hardware:
    """A built-in name (``h200``, ``b300``) or a JSON/YAML file describing one node.

    The file holds one object with the fields of ``Hardware`` (memory either in bytes,
    ``hbm_bytes``, or in GB, ``hbm_gb``; likewise ``host_ram``, the reserves) and optionally
    ``base: <built-in name>`` to start from a built-in node and override some fields.
    """
    if isinstance(spec, Hardware):
        hw = spec
    elif str(spec).lower() in HARDWARE:
        return HARDWARE[str(spec).lower()]
    elif not os.path.exists(spec):
        raise ValueError(f"unknown hardware {str(spec)!r}: use a built-in node ({', '.join(sorted(HARDWARE))}) "
                         f"or the path of a JSON/YAML file describing one")
    else:
        path = str(spec)
        text = open(path).read()
        if path.endswith((".yaml", ".yml")):
            if not _yaml_available():
                raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the node as JSON")
            import yaml
            try:
                d = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ValueError(f"{path}: not valid YAML ({e})") from e
        else:
            try:
                d = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from e
        hw = hardware_from_dict(d, source=path)
    problems = hw.problems()
    if problems:
        raise ValueError(f"invalid hardware {hw.name!r}:\n" + "\n".join(f"  - {x}" for x in problems))
    return hw


def hardware_from_dict(d: Any, source: str = "hardware") -> Hardware:
    if not isinstance(d, dict):
        raise ValueError(f"{source}: a hardware description must be an object (mapping), got {type(d).__name__}")
    d = dict(d)
    base_name = d.pop("base", None)
    names = {f.name for f in dataclasses.fields(Hardware)}
    kw: dict[str, Any] = {}
    if base_name is not None:
        if str(base_name).lower() not in HARDWARE:
            raise ValueError(f"{source}: unknown base {base_name!r}; choose one of {sorted(HARDWARE)}")
        kw = dataclasses.asdict(HARDWARE[str(base_name).lower()])
        kw["notes"] = f"based on {base_name}"
    unknown = []
    for k, v in d.items():
        if k in _HW_GB_FIELDS:
            if _HW_GB_FIELDS[k] in d:
                raise ValueError(f"{source}: give either {k} or {_HW_GB_FIELDS[k]}, not both")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"{source}: {k} must be a number, got {v!r}")
            kw[_HW_GB_FIELDS[k]] = v * GB
        elif k in names:
            kw[k] = v
        else:
            unknown.append(k)
    if unknown:
        raise ValueError(f"{source}: unknown hardware fields {sorted(unknown)}; known: "
                         f"{sorted(names | set(_HW_GB_FIELDS) | {'base'})}")
    kw.setdefault("name", os.path.splitext(os.path.basename(source))[0])
    missing = [f.name for f in dataclasses.fields(Hardware)
               if f.name not in kw and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{source}: missing hardware fields {missing} (or start from a built-in with 'base: h200')")
    return Hardware(**kw)


# =====================================================================================  layout
@dataclass(frozen=True)
class Layout:
    """Parallel layout of one training job. World size = TP x CP x DP x PP.

    TP shards attention heads and the dense/shared MLPs (with sequence parallelism); EP shards the
    routed experts and is drawn from the TP x CP x DP GPUs of a pipeline stage (so it must divide
    their number); PP splits the layers (``pp_layout``: explicit layers per stage, else aligned to
    AttnRes blocks); CP splits sequences; DP replicates. With ``fsdp`` the weights, gradients and
    experts are additionally sharded over the data-parallel GPUs of a stage (DP x CP). The host
    optimizer state is always sharded over data-parallel ranks (a distributed optimizer).
    """

    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    fsdp: bool = False
    pp_layout: tuple[int, ...] | None = None

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def gpus_per_stage(self) -> int:
        return self.tp * self.cp * self.dp

    def problems(self, config: K3Config) -> list[str]:
        p = []
        for name in ("tp", "ep", "pp", "cp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                p.append(f"{name.upper()} must be a positive integer, got {v!r}")
        if p:
            return p
        if self.pp > config.num_hidden_layers:
            p.append(f"PP={self.pp} is larger than the model's {config.num_hidden_layers} decoder layers: "
                     f"every stage needs at least one layer")
        if config.num_experts % self.ep:
            p.append(f"EP={self.ep} must divide num_experts={config.num_experts}")
        if self.gpus_per_stage % self.ep:
            p.append(f"EP={self.ep} must divide the GPUs of a pipeline stage, TP x CP x DP = {self.gpus_per_stage} "
                     f"(expert-parallel groups are drawn from them)")
        for heads, what in ((config.kda_num_heads, "kda_num_heads"), (config.num_attention_heads, "num_attention_heads")):
            if heads % self.tp:
                p.append(f"TP={self.tp} must divide {what}={heads}")
        return p


@dataclass(frozen=True)
class Kernels:
    """Which implementation the activation estimate assumes (SiTU-GLU is evaluated both ways).

    ``elementwise``: ``"eager"`` = k3core today (RMSNorm, the AttnRes mix, the KDA gate and short
    convolution keep fp32 copies of their inputs for backward); ``"fused"`` = fused kernels that
    keep only their bf16 inputs and fp32 per-row statistics.
    ``logits_chunk``: 0 = k3core today (full ``[T, vocab]`` logits, an fp32 copy saved for the
    log-softmax); N > 0 = a fused loss over N-token chunks (only one chunk's logits ever exist).
    """

    elementwise: str = "eager"
    logits_chunk: int = 0
    kda_chunk: int = 64

    def problems(self) -> list[str]:
        p = []
        if self.elementwise not in ("eager", "fused"):
            p.append(f"elementwise must be 'eager' or 'fused', got {self.elementwise!r}")
        if not isinstance(self.logits_chunk, int) or self.logits_chunk < 0:
            p.append(f"logits_chunk must be a non-negative integer (0 = full logits), got {self.logits_chunk!r}")
        if not isinstance(self.kda_chunk, int) or self.kda_chunk < 1:
            p.append(f"kda_chunk must be a positive integer, got {self.kda_chunk!r}")
        return p


def _raise(problems: list[str], what: str) -> None:
    if problems:
        raise ValueError(f"invalid {what}:\n" + "\n".join(f"  - {x}" for x in problems))


# =====================================================================================  parameters
@dataclass(frozen=True)
class ParamCounts:
    """``model_info``'s counts, distributed over layers. ``per_layer[i]`` = (non-routed, routed)
    parameters of decoder layer i (0-based); ``head`` / ``tail`` = parameters held by the first /
    last pipeline stage besides layers (input embedding; lm_head, final norm and output AttnRes)."""

    total: int
    active: int
    routed: int
    routed_active: int
    fp32: int
    bytes_bf16: int
    bytes_mxfp4_routed: int
    per_layer: tuple[tuple[float, float], ...]
    head: float
    tail: float
    by_kind: dict[str, int]


@functools.lru_cache(maxsize=16)
def _model_info_cached(config_json: str) -> dict:
    from k3core.model.info import model_info  # imports the model (torch); only when counts are needed

    return model_info(K3Config.from_hf_dict(json.loads(config_json)))


def param_counts(config: K3Config) -> ParamCounts:
    """Counts from ``model_info`` (meta device), spread over layers by kind: each attention kind's
    total is split evenly over the layers of that kind, the MoE kinds over the MoE layers, the dense
    MLP over the dense layers, and norms/AttnRes weights evenly over all layers (a few vectors of
    ``hidden_size`` each). Embeddings: half at the head (input embedding), half at the tail
    (lm_head; K3 does not tie them)."""
    info = _model_info_cached(_config_key(config))
    k = dict(info["params_by_kind"])
    L = config.num_hidden_layers
    types = [config.layer_type(i) for i in range(L)]
    n_kda, n_mla = types.count("kda"), types.count("mla")
    moe = [config.is_moe_layer(i) for i in range(L)]
    n_moe, n_dense = sum(moe), L - sum(moe)
    per_layer = []
    for i in range(L):
        nr = k.get("norms_attnres", 0) / L
        nr += k.get("kda", 0) / n_kda if types[i] == "kda" else k.get("mla", 0) / n_mla
        if moe[i]:
            nr += (k.get("shared_experts", 0) + k.get("moe_router_latent", 0)) / n_moe
            routed = k.get("routed_experts", 0) / n_moe
        else:
            nr += k.get("dense_mlp", 0) / n_dense
            routed = 0.0
        per_layer.append((nr, routed))
    emb = k.get("embeddings", 0)
    return ParamCounts(
        total=info["total_params"], active=info["active_params"], routed=info["routed_params"],
        routed_active=info["routed_active_params"], fp32=info["fp32_params"], bytes_bf16=info["bytes_bf16"],
        bytes_mxfp4_routed=info["bytes_mxfp4_routed"], per_layer=tuple(per_layer), head=emb / 2, tail=emb / 2,
        by_kind=k,
    )


def host_adam_bytes_per_param(streamed: bool) -> int:
    """fp32 master (4) + bf16 first and second moments (2 + 2), plus the fp32 gradient buffer (4)
    unless the update is streamed in chunks straight from the incoming gradients: 12 -> 8."""
    return MASTER_FP32 + MOMENTS_BF16 + (0 if streamed else HOST_GRAD_FP32)


def gpu_bytes_per_param() -> int:
    """bf16 weights + bf16 gradients on the GPU (the host holds everything fp32)."""
    return GPU_WEIGHT_BF16 + GPU_GRAD_BF16


# =====================================================================================  activations
def situ_glu_saved_bytes(rows: float, width: int, streaming: bool) -> float:
    """Bytes SiTU-GLU keeps for backward on ``[rows, 2*width]`` bf16 input.

    Naive autograd: six fp32 ``[rows, width]`` tensors (24 bytes per output element); the
    streaming op (``k3core.ops.situ.situ_glu``): only the bf16 input ``[rows, 2*width]`` (4 bytes
    per output element), 1/6 of it."""
    return rows * width * (2 * BF16 if streaming else 6 * FP32)


def snapshots_before(config: K3Config, layer: int) -> int:
    """AttnRes block snapshots that exist when 0-based ``layer`` starts: one per earlier layer that
    opened a block (layer 0 appends the embedding output)."""
    return sum(1 for j in range(layer) if j % config.attn_res_block_size == 0)


def _mix_terms(candidates: int, D: int, eager: bool, saves_partial_sum: bool) -> float:
    """One AttnRes mix over ``candidates`` ``[D]`` vectors, per token. Eager (k3core): the stacked
    candidates and their normalised copy, both fp32, plus rstd and softmax weights. Fused: rstd and
    weights only, and the partial sum when it is not already kept as a layer input."""
    if candidates == 0:
        return 0.0
    stats = 2 * FP32 * candidates
    if eager:
        return 2 * FP32 * candidates * D + stats
    return stats + (BF16 * D if saves_partial_sum else 0)


def _norm_terms(width: int, eager: bool) -> float:
    """RMSNorm per token: eager (k3core) keeps the fp32 input copy and the fp32 normalised value;
    fused keeps the bf16 input and the fp32 rstd."""
    return (2 * FP32 * width if eager else BF16 * width) + FP32


def layer_activation_terms(config: K3Config, layer: int, kernels: Kernels = Kernels(),
                           situ_streaming: bool = True) -> dict[str, float]:
    """Bytes per token that autograd keeps for backward in decoder ``layer`` (0-based), by term.

    Follows k3core's layers op by op (see each block below), with fla's ``chunk_kda`` and a flash
    SDPA kernel on CUDA. Keys: ``attnres_norms``, ``kda`` or ``mla``, ``moe_latent`` (routed path
    in the latent width, SiTU excluded), ``shared_expert`` or ``dense_mlp`` (SiTU excluded),
    ``situ_routed``, ``situ_shared`` / ``situ_dense``, ``routing`` (router and dispatch tensors).
    """
    c = config
    eager = kernels.elementwise == "eager"
    D = c.hidden_size
    out: dict[str, float] = {}

    # Decoder-layer wrapper: two AttnRes mix sites and two RMSNorms.
    n_before = snapshots_before(c, layer)
    n_after = n_before + (1 if layer % c.attn_res_block_size == 0 else 0)
    attn_cands = n_before + 1 if n_before else 0
    out["attnres_norms"] = (_mix_terms(attn_cands, D, eager, saves_partial_sum=False)
                            + _mix_terms(n_after + 1, D, eager, saves_partial_sum=True)
                            + 2 * _norm_terms(D, eager))

    if c.layer_type(layer) == "kda":
        H, K = c.kda_num_heads, c.kda_head_dim
        HK = H * K
        conv = 3 * (2 * FP32 * HK if eager else BF16 * HK)  # eager: fp32 padded input + fp32 SiLU input
        # eager (k3core: kda_gate in torch): fp32 f + dt_bias and the fp32 sigmoid; fused: raw bf16 f
        gate = 2 * FP32 * HK if eager else BF16 * HK
        kernel = (3 * BF16 * HK          # q, k (L2-normed), v
                  + FP32 * HK            # cumulative log gate
                  + 2 * FP32 * H         # q, k rstd
                  + 2 * FP32 * H * kernels.kda_chunk)  # Aqk, Akk intra-chunk matrices
        out["kda"] = (BF16 * D           # normed input, shared by the q/k/v/g/f_a/b projections
                      + conv
                      + BF16 * K         # f_a output (low-rank gate)
                      + gate
                      + FP32 * H         # beta = sigmoid(b_proj(x)) in fp32
                      + kernel
                      + _norm_terms(HK, eager) - FP32 + FP32 * H  # o_norm (rstd per head)
                      + 2 * BF16 * HK    # sigmoid(g_proj) and the normed output, for the gate product
                      + BF16 * HK)       # o_proj input
    else:
        H, n, r, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        qr, kr = c.q_lora_rank, c.kv_lora_rank
        out["mla"] = (BF16 * D                        # normed input (q_a, kv_a, g projections)
                      + _norm_terms(qr, eager) + BF16 * qr  # q_a_layernorm, q_b_proj input
                      + (_norm_terms(kr, eager) if eager else FP32 + BF16 * (kr + r))  # kv_a_layernorm
                      + BF16 * (kr + r)               # normed latent + key tail (kv_b input)
                      + BF16 * H * (n + r)            # q for attention
                      + BF16 * H * (n + r)            # k = [k_nope | shared tail] for attention
                      + BF16 * H * (n + v)            # kv_b output (v is a view of it)
                      + BF16 * H * v + FP32 * H       # attention output and log-sum-exp
                      + 2 * BF16 * H * v)             # sigmoid(g_proj), gate product (o_proj input)

    if c.is_moe_layer(layer):
        k, Dl, I, E = c.num_experts_per_token, c.routed_expert_hidden_size, c.moe_intermediate_size, c.num_experts
        S = c.shared_expert_intermediate_size
        out["moe_latent"] = (BF16 * D                 # normed input (router, down-projection, shared experts)
                             + BF16 * k * Dl          # tokens gathered per expert (grouped-GEMM input)
                             + BF16 * k * I           # SiTU output (second grouped-GEMM input)
                             + BF16 * k * Dl          # expert outputs (multiplied by the routing weights)
                             + BF16 * k * Dl          # weighted outputs (index_add keeps its source)
                             + _norm_terms(Dl, eager) + BF16 * Dl)  # routed_expert_norm, up-projection input
        out["situ_routed"] = situ_glu_saved_bytes(k, I, situ_streaming)
        if S:
            out["shared_expert"] = BF16 * S  # SiTU output (down_proj input)
            out["situ_shared"] = situ_glu_saved_bytes(1, S, situ_streaming)
        out["routing"] = ((FP32 * D if eager else 0)  # k3core's router multiplies an fp32 copy of x
                          + FP32 * E                  # sigmoid scores
                          + 3 * INT64 * k             # chosen ids, sort order, token index
                          + FP32 * k + 2 * FP32       # chosen scores, their sum (and its clamp)
                          + BF16 * k)                 # routing weights in the activation dtype
    else:
        I = c.intermediate_size
        out["dense_mlp"] = BF16 * D + BF16 * I  # normed input (gate_up_proj), SiTU output (down_proj)
        out["situ_dense"] = situ_glu_saved_bytes(1, I, situ_streaming)
    return out


def layer_backward_workspace(config: K3Config, layer: int, kernels: Kernels = Kernels(),
                             situ_streaming: bool = True) -> float:
    """Bytes per token of gradients alive at once while the layer's largest op runs backward
    (estimate). MoE: the gradients of the expert outputs, SiTU outputs and SiTU inputs; naive
    SiTU adds four fp32 ``[R, I]`` temporaries of autograd's elementwise chain. Attention: the
    q/k/v/gate gradients of the kernel (fp32 gate), eager convolutions their fp32 input gradients."""
    c = config
    eager = kernels.elementwise == "eager"
    if c.layer_type(layer) == "kda":
        HK = c.kda_num_heads * c.kda_head_dim
        attn = 3 * BF16 * HK + FP32 * HK + (3 * FP32 * HK if eager else 0)
    else:
        H = c.num_attention_heads
        attn = (2 * BF16 * H * (c.qk_nope_head_dim + c.qk_rope_head_dim) + BF16 * H * c.v_head_dim
                + FP32 * H * (c.qk_nope_head_dim + c.qk_rope_head_dim))  # flash keeps dq in fp32
    if c.is_moe_layer(layer):
        k, Dl, I = c.num_experts_per_token, c.routed_expert_hidden_size, c.moe_intermediate_size
        rows, width, extra_dl = k, I, BF16 * k * Dl
    else:
        rows, width, extra_dl = 1, c.intermediate_size, 0
    mlp = extra_dl + BF16 * rows * width + 2 * BF16 * rows * width
    if not situ_streaming:
        mlp += 4 * FP32 * rows * width
    return max(attn, mlp) + BF16 * c.hidden_size  # plus the gradient flowing in


def _logits_bytes(config: K3Config, tokens: float, kernels: Kernels) -> tuple[float, float]:
    """(saved, peak) bytes of the output head on a GPU holding ``tokens`` tokens: the output AttnRes
    mix, final norm and lm_head input, then the loss. Full logits (k3core's ``token_logprobs``): the
    fp32 copy for log-softmax is saved; backward adds its fp32 gradient and the bf16 logits
    gradient. Chunked: one chunk at a time, per-token log-probabilities kept."""
    V, D = config.vocab_size, config.hidden_size
    eager = kernels.elementwise == "eager"
    # the output AttnRes mix over every snapshot, the final norm and the lm_head input come first
    head = (_mix_terms(snapshots_before(config, config.num_hidden_layers) + 1, D, eager, saves_partial_sum=False)
            + _norm_terms(D, eager) + BF16 * D) * tokens
    per_row_peak = (FP32 + FP32 + BF16) * V
    if kernels.logits_chunk:
        rows = min(tokens, kernels.logits_chunk)
        return head + FP32 * tokens, head + rows * per_row_peak
    return head + FP32 * V * tokens, head + tokens * per_row_peak


# =====================================================================================  pipeline
def boundary_bytes(config: K3Config, tokens: float, first_layer_after: int) -> float:
    """Bytes a stage boundary carries per micro-batch for ``tokens`` tokens (per GPU with sequence
    parallelism): the partial sum and every AttnRes snapshot that exists when layer
    ``first_layer_after`` (0-based) starts, all bf16: ``T * hidden * 2 * (1 + K)``."""
    K = snapshots_before(config, first_layer_after)
    return tokens * config.hidden_size * BF16 * (1 + K)


@dataclass(frozen=True)
class StageLayout:
    layers: tuple[int, ...]        # decoder layers per stage
    aligned: bool                  # every boundary falls on an AttnRes block boundary
    explicit: bool

    @property
    def pp(self) -> int:
        return len(self.layers)

    @property
    def starts(self) -> tuple[int, ...]:
        s, out = 0, []
        for n in self.layers:
            out.append(s)
            s += n
        return tuple(out)

    @property
    def utilisation(self) -> float:
        """layers / (PP x max stage layers): the fraction of pipeline time not idle in the bubble-free
        steady state, when every layer costs the same."""
        return sum(self.layers) / (self.pp * max(self.layers))

    def snapshots_crossing(self, config: K3Config) -> tuple[int, ...]:
        """K at each boundary (PP - 1 values)."""
        return tuple(snapshots_before(config, s) for s in self.starts[1:])


def aligned_stage_layout(num_layers: int, block: int, pp: int) -> list[int]:
    """Contiguous stages made of whole AttnRes blocks (the last block may be short), minimising the
    largest stage; among minimal layouts, earlier stages are filled first."""
    if pp < 1:
        raise ValueError(f"PP must be a positive integer, got {pp!r}")
    if pp > num_layers:
        raise ValueError(f"PP={pp} is larger than the model's {num_layers} decoder layers: every stage needs at least one layer")
    blocks = [min(block, num_layers - s) for s in range(0, num_layers, block)]
    if pp > len(blocks):
        raise ValueError(f"PP={pp} exceeds the {len(blocks)} AttnRes blocks of {block} layers: an aligned layout cannot "
                         f"give every stage a whole block; pass an explicit layout (e.g. --pp-layout) to split blocks "
                         f"(their snapshots then cross the boundary mid-block)")

    def stages_needed(cap: int) -> int:
        n, cur = 1, 0
        for b in blocks:
            if cur + b > cap:
                n, cur = n + 1, 0
            cur += b
        return n

    cap = next(c for c in range(max(blocks), num_layers + 1) if stages_needed(c) <= pp)
    out, cur = [], 0
    for j, b in enumerate(blocks):
        remaining_blocks = len(blocks) - j
        remaining_stages = pp - len(out)
        # close the stage when full, or when every later stage still needs at least one block
        if cur and (cur + b > cap or remaining_blocks < remaining_stages):
            out.append(cur)
            cur = 0
        cur += b
    out.append(cur)
    return out


def check_stage_layout(config: K3Config, layers: Iterable[int], pp: int | None = None) -> list[int]:
    """Validate an explicit layout (layers per stage); raise a ValueError that says what is wrong."""
    layers = list(layers)
    L = config.num_hidden_layers
    if not layers:
        raise ValueError("empty pipeline layout: give the number of decoder layers of each stage, e.g. 32,32,29")
    if any(not isinstance(n, int) or isinstance(n, bool) for n in layers):
        raise ValueError(f"pipeline layout {layers}: entries must be integers (decoder layers per stage)")
    empty = [i for i, n in enumerate(layers) if n < 1]
    if empty:
        raise ValueError(f"pipeline layout {layers} leaves stage(s) {empty} without decoder layers: every stage needs >= 1")
    if pp is not None and len(layers) != pp:
        raise ValueError(f"pipeline layout {layers} has {len(layers)} stages but PP={pp}")
    if len(layers) > L:
        raise ValueError(f"PP={len(layers)} is larger than the model's {L} decoder layers")
    total = sum(layers)
    if total > L:
        raise ValueError(f"pipeline layout {layers} covers {total} layers but the model has {L}: "
                         f"{total - L} layer(s) would be placed twice")
    if total < L:
        raise ValueError(f"pipeline layout {layers} covers {total} layers but the model has {L}: "
                         f"layers {total}..{L - 1} (0-based) would belong to no stage")
    return layers


def stage_layout(config: K3Config, pp: int, explicit: Iterable[int] | None = None) -> StageLayout:
    if explicit is not None:
        layers = check_stage_layout(config, explicit, pp)
    else:
        layers = aligned_stage_layout(config.num_hidden_layers, config.attn_res_block_size, pp)
    starts = [sum(layers[:i]) for i in range(1, len(layers))]
    aligned = all(s % config.attn_res_block_size == 0 for s in starts)
    return StageLayout(tuple(layers), aligned, explicit is not None)


# =====================================================================================  context memory
@functools.lru_cache(maxsize=64)
def _per_layer_bytes(config_json: str, kernels: Kernels, situ_streaming: bool) -> tuple[tuple[float, float], ...]:
    """(saved, backward workspace) bytes per token of every layer; cached, the planner asks often."""
    c = K3Config.from_hf_dict(json.loads(config_json))
    return tuple((sum(layer_activation_terms(c, i, kernels, situ_streaming).values()),
                  layer_backward_workspace(c, i, kernels, situ_streaming)) for i in range(c.num_hidden_layers))


def _config_key(config: K3Config) -> str:
    return json.dumps(config.to_hf_dict(), sort_keys=True)


def context_table(config: K3Config, tokens: float, kernels: Kernels = Kernels()) -> dict[str, Any]:
    """The whole model on one GPU holding ``tokens`` tokens (PP = 1): per term, bytes in the layer
    that peaks, number of layers with the term, all layers without checkpointing, and the peak with
    per-layer checkpointing; for streaming and naive SiTU-GLU."""
    c = config
    L = c.num_hidden_layers
    T = tokens
    out: dict[str, Any] = {"tokens_per_gpu": T, "rows": {}, "totals": {}}
    for streaming in (True, False):
        tag = "streaming" if streaming else "naive"
        terms = [layer_activation_terms(c, i, kernels, streaming) for i in range(L)]
        ws = [layer_backward_workspace(c, i, kernels, streaming) for i in range(L)]
        peaks = [sum(t.values()) + w for t, w in zip(terms, ws)]
        worst = max(range(L), key=lambda i: peaks[i])
        keys = sorted({k for t in terms for k in t})
        for key in keys:
            per_layer = max(t.get(key, 0.0) for t in terms)
            row = out["rows"].setdefault(key, {})
            row.update({f"per_layer_{tag}": per_layer * T, "layers": sum(1 for t in terms if key in t),
                        f"no_ac_{tag}": sum(t.get(key, 0.0) for t in terms) * T,
                        f"ac_{tag}": terms[worst].get(key, 0.0) * T})
        n_moe = len(c.moe_layers)
        logits_saved, logits_peak = _logits_bytes(c, T, kernels)
        K_total = snapshots_before(c, L)
        extra = {
            "stash": {f"per_layer_{tag}": BF16 * c.hidden_size * T, "layers": L, f"no_ac_{tag}": 0.0,
                      f"ac_{tag}": BF16 * c.hidden_size * T * L},
            "block_grads": {f"per_layer_{tag}": 0.0, "layers": 0, f"no_ac_{tag}": BF16 * c.hidden_size * T * K_total,
                            f"ac_{tag}": BF16 * c.hidden_size * T * K_total},
            "backward_workspace": {f"per_layer_{tag}": max(ws) * T, "layers": L, f"no_ac_{tag}": max(ws) * T,
                                   f"ac_{tag}": ws[worst] * T},
            "routing_record": {f"per_layer_{tag}": INT64 * c.num_experts_per_token * T, "layers": n_moe,
                               f"no_ac_{tag}": INT64 * c.num_experts_per_token * n_moe * T,
                               f"ac_{tag}": INT64 * c.num_experts_per_token * n_moe * T},
            "logits_saved": {f"per_layer_{tag}": 0.0, "layers": 0, f"no_ac_{tag}": logits_saved, f"ac_{tag}": logits_saved},
            "logits_backward": {f"per_layer_{tag}": 0.0, "layers": 0, f"no_ac_{tag}": logits_peak - logits_saved,
                                f"ac_{tag}": logits_peak - logits_saved},
        }
        for key, row in extra.items():
            out["rows"].setdefault(key, {}).update(row)
        mem = stage_memory(c, T, range(L), inflight=1, k_in=0, is_last=True, kernels=kernels,
                           situ_streaming=streaming, ac=True)
        mem_no = stage_memory(c, T, range(L), inflight=1, k_in=0, is_last=True, kernels=kernels,
                              situ_streaming=streaming, ac=False)
        out["totals"][f"ac_{tag}"] = mem["total"]
        out["totals"][f"no_ac_{tag}"] = mem_no["total"]
        out[f"worst_layer_{tag}"] = worst
    return out


def stage_memory(config: K3Config, tokens: float, layers: Iterable[int], *, inflight: int, k_in: int,
                 is_last: bool, kernels: Kernels = Kernels(), situ_streaming: bool = True,
                 ac: bool = True) -> dict[str, float]:
    """Peak context-shaped bytes on one GPU of a pipeline stage holding ``layers``.

    ``inflight``: micro-batches whose activations the stage holds at once (1F1B: PP - stage index);
    ``k_in``: AttnRes snapshots received from the previous stage. With checkpointing, each layer
    keeps its input (the snapshots are earlier layers' inputs, so they cost nothing more) and the
    peak adds one layer's recomputed activations and backward workspace; without it, every layer's
    saved tensors stay. The loss head's peak and the layers' backward peak do not coincide.
    """
    c = config
    layers = list(layers)
    T = tokens
    D = c.hidden_size
    table = _per_layer_bytes(_config_key(c), kernels, situ_streaming)
    saved = [table[i][0] for i in layers]
    ws = [table[i][1] for i in layers]
    k_out = snapshots_before(c, layers[-1] + 1) if layers else k_in
    n_moe = sum(1 for i in layers if c.is_moe_layer(i))
    routing_record = INT64 * c.num_experts_per_token * n_moe * T * inflight
    received = BF16 * D * T * k_in * inflight
    if ac:
        kept = BF16 * D * T * len(layers) * inflight + received
        layer_peak = max((s + w) * T for s, w in zip(saved, ws))
    else:
        kept = sum(saved) * T * inflight + received + BF16 * D * T * (k_out - k_in) * inflight
        layer_peak = max(ws) * T
    block_grads = BF16 * D * T * k_out
    logits_peak = _logits_bytes(c, T, kernels)[1] if is_last else 0.0
    # the loss head runs backward first (its peak includes the saved logits); layers after it
    transient = max(logits_peak, layer_peak + block_grads)
    total = kept + routing_record + transient
    return {"kept": kept, "routing_record": routing_record, "layer_peak": layer_peak, "block_grads": block_grads,
            "logits_peak": logits_peak, "transient": transient, "total": total}


# =====================================================================================  training replica
@dataclass(frozen=True)
class ReplicaSize:
    """Smallest whole number of nodes holding one copy of the training state with ideal sharding."""

    situ_streaming: bool
    streamed_adam: bool
    tokens_per_gpu: float
    context_bytes_per_gpu: float
    gpu_state_bytes: float          # bf16 weights + gradients, whole model
    host_state_bytes: float         # optimizer state, whole model
    nodes_for_hbm: int | None       # None: the activations alone do not fit in one GPU's HBM
    nodes_for_host: int
    nodes: int | None
    gpus: int | None
    bound: str                      # "hbm", "host" or "infeasible"


def _context_peak_per_gpu(config, tokens, layout: Layout, kernels, situ_streaming, ac) -> float:
    """Context bytes of the layout's worst pipeline stage (1F1B: stage s holds PP - s micro-batches)."""
    st = stage_layout(config, layout.pp, layout.pp_layout)
    worst = 0.0
    for s, (start, n) in enumerate(zip(st.starts, st.layers)):
        m = stage_memory(config, tokens, range(start, start + n), inflight=layout.pp - s,
                         k_in=snapshots_before(config, start), is_last=s == layout.pp - 1, kernels=kernels,
                         situ_streaming=situ_streaming, ac=ac)
        worst = max(worst, m["total"])
    return worst


def replica_size(config: K3Config, hw: str | Hardware, tokens: float, *, situ_streaming: bool, streamed_adam: bool,
                 layout: Layout = Layout(), kernels: Kernels = Kernels(), ac: bool = True) -> ReplicaSize:
    """Nodes such that (a) every GPU holds its share of bf16 weights + gradients beside the peak
    context bytes of the layout's worst pipeline stage, and (b) every node's host RAM holds its
    share of the optimizer state. Sharding is taken as ideal (even over all GPUs / nodes); whether
    a concrete TP/EP/PP layout achieves it is reported per layout by ``plan``."""
    hw = load_hardware(hw)
    pc = param_counts(config)
    ctx = _context_peak_per_gpu(config, tokens, layout, kernels, situ_streaming, ac)
    gpu_state = pc.bytes_bf16 * (gpu_bytes_per_param() / GPU_WEIGHT_BF16)
    host_state = pc.total * host_adam_bytes_per_param(streamed_adam)
    nodes_host = math.ceil(host_state / hw.host_usable)
    free = hw.hbm_usable - ctx
    if free <= 0:
        return ReplicaSize(situ_streaming, streamed_adam, tokens, ctx, gpu_state, host_state, None, nodes_host,
                           None, None, "infeasible")
    nodes_hbm = math.ceil(math.ceil(gpu_state / free) / hw.gpus_per_node)
    nodes = max(nodes_hbm, nodes_host)
    return ReplicaSize(situ_streaming, streamed_adam, tokens, ctx, gpu_state, host_state, nodes_hbm, nodes_host,
                       nodes, nodes * hw.gpus_per_node, "hbm" if nodes_hbm >= nodes_host else "host")


def replica_sweep(config: K3Config, hw: str | Hardware, tokens_list: Iterable[float], *, layout: Layout = Layout(),
                  kernels: Kernels = Kernels(), ac: bool = True) -> list[dict[str, Any]]:
    """For each token count: GPUs per replica without either streaming optimisation, with each one,
    with both, and the relative saving of both (None where the baseline does not fit at all)."""
    hw = load_hardware(hw)
    rows = []
    for T in tokens_list:
        r = {(s, a): replica_size(config, hw, T, situ_streaming=s, streamed_adam=a, layout=layout,
                                  kernels=kernels, ac=ac) for s in (False, True) for a in (False, True)}
        base, both = r[(False, False)].gpus, r[(True, True)].gpus
        rows.append({"tokens_per_gpu": T, "neither": r[(False, False)], "situ_only": r[(True, False)],
                     "adam_only": r[(False, True)], "both": r[(True, True)],
                     "saving": (None if base is None or both is None else 1 - both / base)})
    return rows


def max_tokens_per_gpu(config: K3Config, hw: str | Hardware, gpus: int, *, situ_streaming: bool = True,
                       layout: Layout = Layout(), kernels: Kernels = Kernels(), ac: bool = True) -> int:
    """Largest tokens per GPU whose context bytes fit beside the weights+gradients share of ``gpus``
    GPUs (0 if none); by bisection, since the context bytes grow with tokens."""
    hw = load_hardware(hw)
    pc = param_counts(config)
    free = hw.hbm_usable - pc.bytes_bf16 * (gpu_bytes_per_param() / GPU_WEIGHT_BF16) / gpus

    def fits(T: int) -> bool:
        return _context_peak_per_gpu(config, T, layout, kernels, situ_streaming, ac) <= free

    if free <= 0 or not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# =====================================================================================  rollout engine
def engine_footprint(config: K3Config, hw: str | Hardware, *, sequences: int = 128, context: int = 32768) -> dict[str, Any]:
    """Serving memory of the rollout engine: weights (bf16; or MXFP4 routed experts, W4A8: 4-bit
    weights with one E8M0 scale per 32, 8-bit activations) plus decode state for ``sequences``
    concurrent sequences of ``context`` tokens: the MLA latent cache (``kv_lora_rank + rope`` bf16
    per token and MLA layer) and the KDA state (``H x K x K`` fp32 per sequence and KDA layer) with
    the short-convolution tails. Nodes: whole nodes whose usable HBM holds it all."""
    hw = load_hardware(hw)
    pc = param_counts(config)
    L = config.num_hidden_layers
    n_mla = sum(1 for i in range(L) if config.layer_type(i) == "mla")
    n_kda = L - n_mla
    H, K = config.kda_num_heads, config.kda_head_dim
    mla_cache = BF16 * (config.kv_lora_rank + config.qk_rope_head_dim) * n_mla * context * sequences
    kda_state = (FP32 * H * K * K + BF16 * 3 * H * K * (config.kda_short_conv_kernel_size - 1)) * n_kda * sequences
    cache = mla_cache + kda_state
    node = hw.gpus_per_node * hw.hbm_usable
    out = {"sequences": sequences, "context": context, "mla_latent_cache": mla_cache, "kda_state": kda_state,
           "node_usable_hbm": node}
    for tag, weights in (("bf16", pc.bytes_bf16), ("mxfp4", pc.bytes_mxfp4_routed)):
        total = weights + cache
        out[tag] = {"weights": weights, "total": total, "nodes": math.ceil(total / node),
                    "gpus": math.ceil(total / hw.hbm_usable), "weights_only_nodes": math.ceil(weights / node)}
    return out


def static_decode_state_bytes(config: K3Config, sequences: int, context: int, dtype_bytes: int = BF16) -> int:
    """Bytes of the rollout engine's fixed-shape decode state (``k3core.model.cache.StaticDecodeState``)
    for ``sequences`` slots of ``context`` tokens, engine weights of ``dtype_bytes``: per MLA layer the
    latents ``[S, context, kv_lora_rank + qk_rope_head_dim]`` in the weights' dtype; per KDA layer the
    state ``[S, H, K, K]`` and three short-convolution tails ``[S, H*K, kernel-1]`` in fp32 (fp64 for an
    fp64 engine); two int64 per slot (input token, length). Exact: the state's buffers are these."""
    L = config.num_hidden_layers
    n_mla = sum(1 for i in range(L) if config.layer_type(i) == "mla")
    H, K = config.kda_num_heads, config.kda_head_dim
    state_bytes = 2 * FP32 if dtype_bytes == 8 else FP32
    mla = dtype_bytes * (config.kv_lora_rank + config.qk_rope_head_dim) * context * sequences * n_mla
    kda = state_bytes * (H * K * K + 3 * H * K * (config.kda_short_conv_kernel_size - 1)) * sequences * (L - n_mla)
    return int(mla + kda + 2 * INT64 * sequences)


def device_ledger(config: K3Config, *, trainer_dtype_bytes: int = FP32, engine_dtype_bytes: int = FP32,
                  quantized: bool = True, sequences: int = 128, context: int = 512) -> dict[str, int]:
    """What one process training and sampling ``config`` on one device holds, by owner, in bytes:
    the arithmetic the per-stage peaks of ``metrics.json`` are read against.

    - ``trainer_weights`` / ``trainer_gradients`` (device): every parameter in ``trainer_dtype_bytes``
      except the ones the model keeps fp32 (KDA ``A_log``, ``dt_bias``, short convolutions:
      ``ParamCounts.fp32``); gradients have their parameter's dtype, exist during the train step only,
      and belong to trainable parameters: all but the first layer's attention-mixing pair (two ``[D]``
      vectors the model freezes, since no gradient reaches them);
    - ``trainer_buffers`` (device): the persistent fp32 buffers (the router's expert-score bias);
    - ``host_optimizer_state`` (host): ``StreamedAdamW``'s fp32 master and bf16 moments, 8 B per
      trainable parameter (its chunk stages and scratch are fixed in the model size and not counted);
    - ``engine_weights`` (device): non-routed parameters in ``engine_dtype_bytes`` (fp32 kept),
      routed experts as MXFP4 (half a byte per weight plus one E8M0 scale per 32) when ``quantized``,
      the persistent buffers, and the AttnRes ``w * gamma`` cache (fp32, one ``[D]`` vector per
      mixing site: two per layer and the output's);
    - ``engine_decode_state`` (device): ``static_decode_state_bytes`` for ``sequences`` x ``context``,
      the decode mode on CUDA; held during rollout and evaluation only (released after each).
    Activations are not in the ledger: they depend on the kernels and the micro-batch
    (``context_table``), and exist during the train step only."""
    pc = param_counts(config)
    L = config.num_hidden_layers
    n_moe = sum(1 for i in range(L) if config.is_moe_layer(i))
    non_routed_float = pc.total - pc.routed - pc.fp32
    routed_bytes = pc.routed * (0.5 + 1 / 32) if quantized else pc.routed * engine_dtype_bytes
    trainer = (pc.total - pc.fp32) * trainer_dtype_bytes + pc.fp32 * FP32
    frozen = 2 * config.hidden_size  # layer 0's attention-mixing projection and norm (float, not fp32-kept)
    buffers = FP32 * n_moe * config.num_experts
    return {
        "trainer_weights": int(trainer),
        "trainer_gradients": int(trainer - frozen * trainer_dtype_bytes),
        "trainer_buffers": int(buffers),
        "host_optimizer_state": int((pc.total - frozen) * host_adam_bytes_per_param(streamed=True)),
        "engine_weights": int(non_routed_float * engine_dtype_bytes + pc.fp32 * FP32 + routed_bytes + buffers
                              + FP32 * (2 * L + 1) * config.hidden_size),
        "engine_decode_state": static_decode_state_bytes(config, sequences, context, engine_dtype_bytes),
    }


# =====================================================================================  checkpoint
def checkpoint_report(config: K3Config, fs_gbps: float, *, streamed_adam: bool = True) -> dict[str, Any]:
    """Sizes of the model-only checkpoint (bf16, and with MXFP4 routed experts as released) and of
    the full training state (model bf16 + the host optimizer state: fp32 master and two bf16
    moments; the gradient buffer is never saved), and write times at ``fs_gbps``."""
    if not fs_gbps > 0:
        raise ValueError(f"filesystem bandwidth must be positive, got {fs_gbps!r} GB/s")
    pc = param_counts(config)
    training = pc.bytes_bf16 + pc.total * (MASTER_FP32 + MOMENTS_BF16)
    out = {"fs_gbps": fs_gbps}
    for tag, b in (("model_bf16", pc.bytes_bf16), ("model_mxfp4", pc.bytes_mxfp4_routed), ("training_state", training)):
        out[tag] = {"bytes": b, "bytes_per_param": b / pc.total, "seconds": b / (fs_gbps * GB)}
    return out


# =====================================================================================  the plan
def _layout_report(config: K3Config, hw: Hardware, tokens: float, layout: Layout, kernels: Kernels,
                   ac: bool, streamed_adam: bool, situ_streaming: bool) -> dict[str, Any]:
    pc = param_counts(config)
    st = stage_layout(config, layout.pp, layout.pp_layout)
    dp_shard = layout.dp * layout.cp if layout.fsdp else 1
    routed_shard = layout.gpus_per_stage if layout.fsdp else layout.ep
    stages = []
    for s, (start, n) in enumerate(zip(st.starts, st.layers)):
        nonrouted = sum(pc.per_layer[i][0] for i in range(start, start + n))
        routed = sum(pc.per_layer[i][1] for i in range(start, start + n))
        if s == 0:
            nonrouted += pc.head
        if s == st.pp - 1:
            nonrouted += pc.tail
        per_gpu_params = nonrouted / (layout.tp * dp_shard) + routed / routed_shard
        gather = 0.0
        if layout.fsdp and dp_shard > 1:
            # FSDP gathers a layer's weights before use, the next one in flight (prefetch): the
            # TP shard of the non-routed weights, and the EP shard of the experts when FSDP shards
            # them beyond EP
            experts_gathered = routed_shard > layout.ep
            gather = 2 * GPU_WEIGHT_BF16 * max(pc.per_layer[i][0] / layout.tp
                                               + (pc.per_layer[i][1] / layout.ep if experts_gathered else 0.0)
                                               for i in range(start, start + n))
        owned = nonrouted / (layout.tp * layout.dp * layout.cp) + routed / layout.gpus_per_stage
        ctx = stage_memory(config, tokens, range(start, start + n), inflight=layout.pp - s,
                           k_in=snapshots_before(config, start), is_last=s == st.pp - 1, kernels=kernels,
                           situ_streaming=situ_streaming, ac=ac)
        gpu_total = per_gpu_params * gpu_bytes_per_param() + gather + ctx["total"]
        host_node = owned * host_adam_bytes_per_param(streamed_adam) * min(hw.gpus_per_node, layout.world)
        stages.append({
            "stage": s, "first_layer": start, "layers": n, "params_per_gpu": per_gpu_params,
            "weights_bf16": per_gpu_params * GPU_WEIGHT_BF16, "grads_bf16": per_gpu_params * GPU_GRAD_BF16,
            "fsdp_gather": gather, "context": ctx["total"], "context_detail": ctx, "gpu_total": gpu_total,
            "fits_hbm": gpu_total <= hw.hbm_usable, "owned_params_per_gpu": owned,
            "host_master_fp32": owned * MASTER_FP32 * min(hw.gpus_per_node, layout.world),
            "host_moments_bf16": owned * MOMENTS_BF16 * min(hw.gpus_per_node, layout.world),
            "host_grad_fp32": 0 if streamed_adam else owned * HOST_GRAD_FP32 * min(hw.gpus_per_node, layout.world),
            "host_per_node": host_node, "fits_host": host_node <= hw.host_usable,
            # one direction per step, per GPU: gradients out, updated weights back
            "pcie_bytes_per_step": per_gpu_params * (GPU_GRAD_BF16 + GPU_WEIGHT_BF16),
            "pcie_seconds_per_step": per_gpu_params * (GPU_GRAD_BF16 + GPU_WEIGHT_BF16) / 2 / (hw.pcie_gbps * GB),
        })
    boundaries = []
    for b, start in enumerate(st.starts[1:]):
        nbytes = boundary_bytes(config, tokens, start)
        boundaries.append({"after_stage": b, "first_layer_after": start, "snapshots": snapshots_before(config, start),
                           "bytes_per_gpu": nbytes,
                           "seconds_network": nbytes / (hw.network_gbps * GB / hw.gpus_per_node)})
    k, Dl = config.num_experts_per_token, config.routed_expert_hidden_size
    # dispatch + combine, forward and backward, per MoE layer and micro-batch, per GPU
    a2a = 4 * tokens * k * Dl * BF16 * (1 - 1 / layout.ep)
    a2a_bw = (hw.nvlink_gbps / 2 if layout.ep <= hw.gpus_per_node else hw.network_gbps / hw.gpus_per_node) * GB
    return {
        "layout": dataclasses.asdict(layout), "world": layout.world,
        "nodes": math.ceil(layout.world / hw.gpus_per_node),
        "pp_layers": list(st.layers), "pp_aligned": st.aligned, "pp_utilisation": st.utilisation,
        "stages": stages, "boundaries": boundaries,
        "fits": all(s["fits_hbm"] and s["fits_host"] for s in stages),
        "ep_all_to_all_bytes_per_moe_layer": a2a, "ep_all_to_all_seconds_per_moe_layer": a2a / a2a_bw,
    }


def plan(config: K3Config, hardware: str | Hardware, tokens_per_gpu: float, layout: Layout = Layout(), *,
         kernels: Kernels = Kernels(), ac: bool = True, fs_gbps: float | None = None,
         engine_sequences: int = 128, engine_context: int = 32768,
         sweep_tokens: Iterable[float] = ()) -> dict[str, Any]:
    """Everything the planner computes, as a JSON-ready dict (bytes, seconds, counts)."""
    hw = load_hardware(hardware)
    _raise(layout.problems(config), "parallel layout")
    _raise(kernels.problems(), "kernel choice")
    if not (isinstance(tokens_per_gpu, (int, float)) and not isinstance(tokens_per_gpu, bool) and tokens_per_gpu > 0):
        raise ValueError(f"tokens per GPU must be a positive number, got {tokens_per_gpu!r}")
    for n, v in (("engine sequences", engine_sequences), ("engine context", engine_context)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{n} must be a positive integer, got {v!r}")
    stage_layout(config, layout.pp, layout.pp_layout)  # raises on a bad pipeline layout
    pc = param_counts(config)
    T = tokens_per_gpu
    replicas = {f"{'situ_stream' if s else 'situ_naive'}+{'adam_stream' if a else 'adam_buffer'}":
                replica_size(config, hw, T, situ_streaming=s, streamed_adam=a, layout=layout, kernels=kernels, ac=ac)
                for s in (False, True) for a in (False, True)}
    base, both = replicas["situ_naive+adam_buffer"], replicas["situ_stream+adam_stream"]
    k, I = config.num_experts_per_token, config.moe_intermediate_size
    out = {
        "hardware": dataclasses.asdict(hw),
        "model": {
            "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "kda_layers": sum(1 for i in range(config.num_hidden_layers) if config.layer_type(i) == "kda"),
            "mla_layers": sum(1 for i in range(config.num_hidden_layers) if config.layer_type(i) == "mla"),
            "moe_layers": len(config.moe_layers), "attn_res_blocks": config.num_attn_res_blocks,
            "layer_kinds": [f"{config.layer_type(i).upper()} + {'MoE' if config.is_moe_layer(i) else 'dense MLP'}"
                            for i in range(config.num_hidden_layers)],
            "total_params": pc.total, "active_params": pc.active, "routed_params": pc.routed,
            "routed_active_params": pc.routed_active, "routed_active_fraction": pc.routed_active / pc.active,
            "params_by_kind": pc.by_kind,
        },
        "tokens_per_gpu": T,
        "kernels": dataclasses.asdict(kernels),
        "activation_checkpointing": ac,
        "parameter_bytes": {
            "gpu_weights_bf16": pc.bytes_bf16, "gpu_grads_bf16": pc.bytes_bf16,
            "host_master_fp32": pc.total * MASTER_FP32, "host_moments_bf16": pc.total * MOMENTS_BF16,
            "host_grad_buffer_fp32": pc.total * HOST_GRAD_FP32,
            "host_bytes_per_param_buffered": host_adam_bytes_per_param(False),
            "host_bytes_per_param_streamed": host_adam_bytes_per_param(True),
            "host_total_buffered": pc.total * host_adam_bytes_per_param(False),
            "host_total_streamed": pc.total * host_adam_bytes_per_param(True),
        },
        "situ_routed_one_layer": {
            "rows": T * k, "width": I,
            "naive": situ_glu_saved_bytes(T * k, I, False), "streaming": situ_glu_saved_bytes(T * k, I, True),
        },
        "context": context_table(config, T, kernels),
        "replica": {name: dataclasses.asdict(r) for name, r in replicas.items()},
        "replica_saving": None if base.gpus is None or both.gpus is None else 1 - both.gpus / base.gpus,
        "max_tokens_per_gpu": {
            name: (max_tokens_per_gpu(config, hw, r.gpus, situ_streaming=name.startswith("situ_stream"),
                                      layout=layout, kernels=kernels, ac=ac) if r.gpus else None)
            for name, r in replicas.items()},
        "engine": engine_footprint(config, hw, sequences=engine_sequences, context=engine_context),
        "checkpoint": checkpoint_report(config, hw.filesystem_gbps if fs_gbps is None else fs_gbps),
        "layout": _layout_report(config, hw, T, layout, kernels, ac, streamed_adam=True, situ_streaming=True),
        "sweep": [{"tokens_per_gpu": r["tokens_per_gpu"], "saving": r["saving"],
                   **{k2: dataclasses.asdict(r[k2]) for k2 in ("neither", "situ_only", "adam_only", "both")}}
                  for r in replica_sweep(config, hw, sweep_tokens, layout=layout, kernels=kernels, ac=ac)],
    }
    return out


# =====================================================================================  text
def _gb(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / GB:,.1f}" if abs(x) < 1e15 else f"{x / 1e12:,.0f} TB"


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]


_CONTEXT_LABELS = {
    "kda": "KDA attention", "mla": "MLA attention", "moe_latent": "MoE routed path (latent width)",
    "shared_expert": "shared experts", "dense_mlp": "dense MLP", "situ_routed": "SiTU-GLU routed",
    "situ_shared": "SiTU-GLU shared", "situ_dense": "SiTU-GLU dense", "attnres_norms": "AttnRes mix + RMSNorms",
    "routing": "routing (router, dispatch)", "routing_record": "routing record (replay ids)",
    "stash": "layer-input stash", "block_grads": "AttnRes snapshot grads", "backward_workspace": "backward workspace",
    "logits_saved": "output head + logits saved", "logits_backward": "logits backward extra",
}


def format_plan(p: dict[str, Any], config_name: str = "config") -> str:
    """A readable report of ``plan``'s dict (GB = 1e9 bytes)."""
    hw, m, T = p["hardware"], p["model"], p["tokens_per_gpu"]
    L: list[str] = []
    L.append(f"k3rl plan: {config_name} on {hw['name']} nodes ({hw['gpus_per_node']} GPUs x "
             f"{hw['hbm_bytes'] / GB:.1f} GB HBM, {hw['host_ram_bytes'] / 1e12:.2f} TB host RAM per node), "
             f"{T:,.0f} tokens per GPU")
    L.append(f"  kernels: elementwise={p['kernels']['elementwise']}, logits="
             f"{'full' if not p['kernels']['logits_chunk'] else str(p['kernels']['logits_chunk']) + '-token chunks'}; "
             f"activation checkpointing {'on' if p['activation_checkpointing'] else 'off'} (sizing)")
    L.append(f"  hardware: {hw['notes']}")
    L.append("")
    L.append(f"Model: {m['layers']} layers ({m['kda_layers']} KDA, {m['mla_layers']} MLA, {m['moe_layers']} MoE), "
             f"{m['attn_res_blocks']} AttnRes blocks; {_count(m['total_params'])} parameters, "
             f"{_count(m['active_params'])} active per token, routed experts {_count(m['routed_active_params'])} of them "
             f"({100 * m['routed_active_fraction']:.1f}%)")
    L.append("")
    pb = p["parameter_bytes"]
    L.append("Parameter-shaped bytes, whole model (GB)")
    L += _table(["state", "where", "bytes/param", "GB"], [
        ["weights bf16", "GPU", 2, _gb(pb["gpu_weights_bf16"])],
        ["gradients bf16", "GPU", 2, _gb(pb["gpu_grads_bf16"])],
        ["master weights fp32", "host", 4, _gb(pb["host_master_fp32"])],
        ["Adam moments bf16 x 2", "host", 4, _gb(pb["host_moments_bf16"])],
        ["gradient buffer fp32 (not when streamed)", "host", 4, _gb(pb["host_grad_buffer_fp32"])],
        ["host optimizer, buffered", "host", pb["host_bytes_per_param_buffered"], _gb(pb["host_total_buffered"])],
        ["host optimizer, streamed", "host", pb["host_bytes_per_param_streamed"], _gb(pb["host_total_streamed"])],
    ])
    L.append("")
    s = p["situ_routed_one_layer"]
    L.append(f"SiTU-GLU, routed experts of one MoE layer: R = {s['rows']:,.0f} rows x {s['width']}: naive "
             f"{_gb(s['naive'])} GB (six fp32 [R, H]), streaming {_gb(s['streaming'])} GB "
             f"({s['streaming'] / s['naive']:.3f} of naive), saves {_gb(s['naive'] - s['streaming'])} GB "
             f"({(s['naive'] - s['streaming']) / 2**30:,.1f} GiB)")
    L.append("")
    ctx = p["context"]
    L.append(f"Context-shaped bytes per GPU, whole model on one stage (PP=1), GB at {T:,.0f} tokens "
             f"(AC = per-layer activation checkpointing)")
    rows = []
    for key, r in ctx["rows"].items():
        a, b = r["per_layer_streaming"], r["per_layer_naive"]
        per_layer = "" if not r["layers"] else _gb(a) if a == b else f"{_gb(a)} / {_gb(b)}"
        rows.append([_CONTEXT_LABELS.get(key, key), per_layer, r["layers"] or "",
                     _gb(r["no_ac_streaming"]), _gb(r["no_ac_naive"]), _gb(r["ac_streaming"]), _gb(r["ac_naive"])])
    order = list(_CONTEXT_LABELS.values())
    rows.sort(key=lambda r: order.index(r[0]) if r[0] in order else 99)
    t = ctx["totals"]
    rows.append(["total peak", "", "", _gb(t["no_ac_streaming"]), _gb(t["no_ac_naive"]), _gb(t["ac_streaming"]),
                 _gb(t["ac_naive"])])
    L += _table(["term", "per layer (stream / naive)", "layers", "no AC, stream", "no AC, naive", "AC, stream", "AC, naive"], rows)
    w = ctx["worst_layer_streaming"]
    L.append(f"  (per layer: the largest layer with the term; SiTU stream/naive = streaming op vs plain autograd; "
             f"AC columns: what checkpointing keeps plus the recomputed layer that peaks, layer {w} "
             f"({p['model']['layer_kinds'][w]}); totals are peaks: the loss head and the layers' backward peak "
             f"at different times)")
    L.append("")
    L.append("GPUs per training replica (ideal sharding; bf16 weights+grads on GPU beside the worst stage's "
             "context bytes, optimizer state in host RAM)")
    rows = []
    names = {"situ_naive+adam_buffer": "neither (naive SiTU, buffered Adam)",
             "situ_stream+adam_buffer": "streaming SiTU only", "situ_naive+adam_stream": "streamed Adam only",
             "situ_stream+adam_stream": "both streaming optimisations"}
    for key, label in names.items():
        r = p["replica"][key]
        rows.append([label, _gb(r["context_bytes_per_gpu"]), r["nodes_for_hbm"] if r["nodes_for_hbm"] else "no fit",
                     r["nodes_for_host"], r["nodes"] or "-", r["gpus"] or "-", r["bound"],
                     f"{p['max_tokens_per_gpu'][key]:,}" if p["max_tokens_per_gpu"][key] else "-"])
    L += _table(["variant", "context GB/GPU", "nodes (HBM)", "nodes (host)", "nodes", "GPUs", "bound",
                 "max tokens/GPU"], rows)
    sav = p["replica_saving"]
    L.append(f"  saving of both: {'-' if sav is None else f'{100 * sav:.0f}% fewer GPUs'}"
             + ("" if sav is not None else " (the baseline does not fit at this token count)"))
    if p["sweep"]:
        L.append("")
        L.append("GPUs per replica by tokens per GPU")
        rows = [[f"{r['tokens_per_gpu']:,.0f}"] + [r[k]["gpus"] or "no fit" for k in ("neither", "situ_only",
                                                                                     "adam_only", "both")]
                + ["-" if r["saving"] is None else f"{100 * r['saving']:.0f}%"] for r in p["sweep"]]
        L += _table(["tokens/GPU", "neither", "SiTU only", "Adam only", "both", "saving"], rows)
    L.append("")
    e = p["engine"]
    L.append(f"Rollout engine ({e['sequences']} sequences x {e['context']:,} tokens: MLA latent cache "
             f"{_gb(e['mla_latent_cache'])} GB, KDA state {_gb(e['kda_state'])} GB; "
             f"{_gb(e['node_usable_hbm'])} GB usable HBM per node)")
    L += _table(["weights", "weights GB", "total GB", "GPUs", "nodes"], [
        ["bf16", _gb(e["bf16"]["weights"]), _gb(e["bf16"]["total"]), e["bf16"]["gpus"], e["bf16"]["nodes"]],
        ["MXFP4 routed (W4A8)", _gb(e["mxfp4"]["weights"]), _gb(e["mxfp4"]["total"]), e["mxfp4"]["gpus"],
         e["mxfp4"]["nodes"]],
    ])
    L.append("")
    c = p["checkpoint"]
    L.append(f"Checkpoints (filesystem {c['fs_gbps']} GB/s)")
    L += _table(["checkpoint", "GB", "bytes/param", "save minutes"], [
        [lab, _gb(c[k]["bytes"]), f"{c[k]['bytes_per_param']:.2f}", f"{c[k]['seconds'] / 60:.1f}"]
        for k, lab in (("model_bf16", "model, bf16"), ("model_mxfp4", "model, MXFP4 routed experts"),
                       ("training_state", "full training state"))])
    L.append("")
    lay = p["layout"]
    ly = lay["layout"]
    L.append(f"Layout TP={ly['tp']} EP={ly['ep']} PP={ly['pp']} CP={ly['cp']} DP={ly['dp']} "
             f"FSDP={'on' if ly['fsdp'] else 'off'}: {lay['world']} GPU(s) on {lay['nodes']} node(s); "
             f"streaming SiTU + streamed Adam; stages {lay['pp_layers']} "
             f"({'aligned to AttnRes blocks' if lay['pp_aligned'] else 'splits AttnRes blocks'}), "
             f"utilisation {100 * lay['pp_utilisation']:.3f}%")
    rows = [[st["stage"], f"{st['first_layer']}-{st['first_layer'] + st['layers'] - 1}", st["layers"],
             _gb(st["weights_bf16"] + st["grads_bf16"] + st["fsdp_gather"]), _gb(st["context"]), _gb(st["gpu_total"]),
             "yes" if st["fits_hbm"] else "NO", _gb(st["host_per_node"]), "yes" if st["fits_host"] else "NO",
             f"{st['pcie_seconds_per_step']:.2f}"] for st in lay["stages"]]
    L += _table(["stage", "layers", "n", "params GB/GPU", "context GB/GPU", "total GB/GPU", "fits HBM",
                 "host GB/node", "fits host", "PCIe s/step"], rows)
    if lay["boundaries"]:
        L.append("  stage boundaries (per GPU and micro-batch: hidden state + K AttnRes snapshots, bf16):")
        for b in lay["boundaries"]:
            L.append(f"    after stage {b['after_stage']} (layer {b['first_layer_after']} next): K={b['snapshots']}, "
                     f"{_gb(b['bytes_per_gpu'])} GB, {1e3 * b['seconds_network']:.1f} ms at the network share of one GPU")
    L.append(f"  EP all-to-all per MoE layer and micro-batch (dispatch+combine, fwd+bwd) per GPU: "
             f"{_gb(lay['ep_all_to_all_bytes_per_moe_layer'])} GB, "
             f"{1e3 * lay['ep_all_to_all_seconds_per_moe_layer']:.1f} ms lower bound")
    L.append(f"  fits: {'yes' if lay['fits'] else 'NO'}")
    return "\n".join(L)
