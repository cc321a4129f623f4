"""The work of each pipeline stage, on paths and tables (the Prefect tasks in ``tasks/`` wrap these).

Nothing here knows about Prefect or the artifact store: functions take local paths and return
tables or small dicts. The trainer state is a torch.distributed.checkpoint directory holding the
model, the optimizer, the RNG states, the data cursor and the iteration; rollout weights are a
public-layout checkpoint whose routed experts are MXFP4.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.data import ROLLOUT_SCHEMA, SCORED_SCHEMA
from k3core.rl.envs import checked_reward
from k3core.rl.grpo import group_advantages
from k3core.rl.train import GRPOConfig, RLSequence, grpo_train_step, sft_step
from k3core.rollout.engine import RolloutEngine, SamplingParams
from k3core.tokenizer import ByteTokenizer

ROUTED_EXPERT_SUFFIXES = (".experts.w13", ".experts.w2")


# ------------------------------------------------------------------ weights and engine
def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> K3ForCausalLM:
    from k3core.checkpoint.hf import load_model

    return load_model(path, dtype=dtype)


def mxfp4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """What an MXFP4 engine holds for a routed-expert weight: dequantize(quantize(w))."""
    from k3core.ops.mxfp4 import dequantize, quantize

    packed, scale = quantize(w.detach())
    return dequantize(packed, scale, dtype=w.dtype)


def engine_state(model: K3ForCausalLM, quantize_experts: bool, w4a8: bool = True) -> dict[str, torch.Tensor]:
    """The tensors a transfer sends: every parameter and persistent buffer of ``model``.

    ``quantize_experts`` (the engine runs MXFP4 routed experts): with ``w4a8`` (the default rollout
    path) each ``experts.w13``/``w2`` goes as its MXFP4 pair ``..._packed``/``..._scale``, the W4A8
    engine's buffers (``k3core.rollout.quantized``), 0.53 bytes per weight on the wire; with
    ``w4a8=False`` as its dequantised round trip under the float names (a float engine running
    MXFP4 weights, activations unquantised)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if not quantize_experts:
        return sd
    if w4a8:
        from k3core.rollout.quantized import packed_expert_state

        return packed_expert_state(sd)
    return {k: mxfp4_roundtrip(v) if k.endswith(ROUTED_EXPERT_SUFFIXES) else v for k, v in sd.items()}


def engine_from_model(model: K3ForCausalLM, weight_version: int, quantized: bool,
                      act_granularity: str | None = "token") -> RolloutEngine:
    """An engine around ``model`` (taken over: with ``quantized`` its routed experts are swapped for
    W4A8 experts in place and the float expert weights dropped). A later transfer into it takes
    ``engine_state(trainer, quantize_experts=quantized)``."""
    if quantized:
        from k3core.rollout.quantized import quantize_engine_model

        quantize_engine_model(model, act_granularity)
    return RolloutEngine(model, weight_version)


def build_engine(weights_path: str | Path, weight_version: int, dtype: torch.dtype = torch.float32,
                 w4a8: bool = True) -> RolloutEngine:
    """An engine from a public-layout checkpoint. An MXFP4 checkpoint gives the W4A8 engine (packed
    expert bytes loaded as they are, FP8 activations; ``w4a8=False``: experts dequantised on load,
    activations unquantised); a bf16 checkpoint gives a float engine."""
    from k3core.checkpoint.files import CONFIG_NAME
    from k3core.checkpoint.hf import checkpoint_target

    config = K3Config.from_json_file(Path(weights_path) / CONFIG_NAME)
    if w4a8 and checkpoint_target(config) == "mxfp4":
        from k3core.rollout.quantized import load_w4a8_model

        return RolloutEngine(load_w4a8_model(weights_path, dtype), weight_version)
    return RolloutEngine(load_policy(weights_path, dtype), weight_version)


# ------------------------------------------------------------------ rollout and scoring
def rollout_table(engine: RolloutEngine, tok: ByteTokenizer, prompts: list[str], params: SamplingParams,
                  iteration: int) -> pa.Table:
    comps = engine.generate([tok.encode(p) for p in prompts], params, pad_id=tok.pad_id)
    rows = {f.name: [] for f in ROLLOUT_SCHEMA}
    for c in comps:
        rows["iteration"].append(iteration)
        rows["prompt_index"].append(c.prompt_index)
        rows["sample_index"].append(c.sample_index)
        rows["prompt"].append(prompts[c.prompt_index])
        rows["prompt_ids"].append(c.prompt_ids)
        rows["output_ids"].append(c.output_ids)
        rows["completion"].append(tok.decode(c.output_ids))
        rows["logprobs"].append(c.logprobs)
        rows["routing"].append(c.routing.reshape(-1).tolist())
        rows["finish_reason"].append(c.finish_reason)
        rows["weight_version"].append(c.weight_version)
    return pa.table(rows, schema=ROLLOUT_SCHEMA)


def score_table(rollouts: pa.Table, env, env_spec: str, group_size: int) -> tuple[pa.Table, dict]:
    """Rewards (checked: finite, in [0, 1]) and GRPO group-normalised advantages."""
    if rollouts.num_rows == 0:
        raise ValueError("no rollouts to score: the rollout table is empty")
    prompts, comps = rollouts.column("prompt").to_pylist(), rollouts.column("completion").to_pylist()
    rewards = torch.tensor([checked_reward(env, p, c, env_spec) for p, c in zip(prompts, comps)])
    order = sorted(range(rollouts.num_rows), key=lambda i: (rollouts["prompt_index"][i].as_py(),
                                                            rollouts["sample_index"][i].as_py()))
    rollouts = rollouts.take(order)
    rewards = rewards[order]
    adv = group_advantages(rewards, group_size)
    table = rollouts.append_column("reward", pa.array(rewards.tolist(), pa.float32()))
    table = table.append_column("advantage", pa.array(adv.tolist(), pa.float32())).cast(SCORED_SCHEMA)
    lens = [len(x) for x in table.column("output_ids").to_pylist()]
    stats = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
             "response_length_mean": sum(lens) / len(lens),
             "solved_fraction": float((rewards == 1.0).float().mean())}
    return table, stats


def table_to_sequences(table: pa.Table, n_moe: int, top_k: int) -> list[RLSequence]:
    seqs = []
    for r in table.to_pylist():
        routing = torch.tensor(r["routing"], dtype=torch.int16).view(-1, n_moe, top_k) if n_moe else None
        seqs.append(RLSequence(r["prompt_ids"], r["output_ids"], r["logprobs"], r["advantage"], routing))
    return seqs


@torch.no_grad()
def evaluate(client, tok: ByteTokenizer, env, env_spec: str, prompts: list[str], max_new_tokens: int,
             temperature: float = 1.0, samples: int = 4, seed: int = 0, expected_version=None) -> dict:
    """Held-out prompts (never trained on), two ways:
    - ``heldout_reward``: the policy's expected reward, the quantity RL maximises: ``samples``
      completions per prompt at the rollout temperature (fixed seed, so versions compare fairly);
    - ``heldout_greedy_reward``: greedy decoding (the policy's mode).
    ``client``: a ``RolloutClient`` (the local engine or a server URL: same seeds, same samples) or a
    ``RolloutEngine``; ``expected_version``: refuse (``WeightVersionMismatch``) an engine serving, or
    a completion produced by, any other weight version."""
    from k3core.rollout.client import RolloutClient

    if isinstance(client, RolloutEngine):
        client = RolloutClient("local", engine=client)

    def score(comps):
        return [checked_reward(env, prompts[c.prompt_index], tok.decode(c.output_ids), env_spec) for c in comps]

    def generate(params):
        return client.generate(ids, params, pad_id=tok.pad_id, expected_version=expected_version)

    stop = (tok.eos_id,)
    ids = [tok.encode(p) for p in prompts]
    sampled = score(generate(SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                            stop_token_ids=stop, n=samples, seed=seed)))
    greedy = score(generate(SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop)))
    return {"heldout_reward": sum(sampled) / len(sampled),
            "heldout_solved": sum(r == 1.0 for r in sampled) / len(sampled),
            "heldout_greedy_reward": sum(greedy) / len(greedy),
            "heldout_greedy_solved": sum(r == 1.0 for r in greedy) / len(greedy), "heldout_n": len(sampled)}


# ------------------------------------------------------------------ trainer state (DCP)
OPTIMIZERS = ("streamed", "adamw")


def make_optimizer(model: K3ForCausalLM, lr: float, weight_decay: float = 0.0,
                   kind: str = "streamed") -> torch.optim.Optimizer:
    """The trainer's optimizer. ``streamed`` (default): ``StreamedAdamW``, fp32 master weights and
    stochastically rounded bf16 moments on the host (8 B/param), updated chunk by chunk with no
    host gradient buffer (issue 6); ``adamw``: ``torch.optim.AdamW`` (fp32 moments), kept as the
    baseline. Gradient clipping stays in the train step (``clip_grad_norm_``), so both see the
    same clipped gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "streamed":
        from k3core.optim.streamed_adam import StreamedAdamW

        return StreamedAdamW(params, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay, foreach=True)
    raise ValueError(f"unknown optimizer {kind!r}: choose one of {OPTIMIZERS}")


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
    dcp.save(state, checkpoint_id=str(out_dir), storage_writer=writer)
    model.config.to_json_file(out_dir / "config.json")
    (out_dir / "extra.json").write_text(json.dumps(extra, indent=2))


def load_trainer_state(path: str | Path, lr: float, dtype: torch.dtype = torch.float32):
    """(model, optimizer, extra) from a trainer-state directory written by ``save_trainer_state``;
    the model trains with QAT when the state was saved with it (``extra['qat_routed_experts']``)."""
    from k3core.checkpoint.hf import meta_model

    path = Path(path)
    config = K3Config.from_json_file(path / "config.json")
    model = meta_model(config)
    model.to_empty(device="cpu")
    model.cast(dtype)
    opt = make_optimizer(model, lr)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "rng": {"torch": torch.get_rng_state(), "python": ""}, "extra": ""}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"]["torch"])
    py = json.loads(state["rng"]["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    extra = json.loads(state["extra"])
    set_qat(model, extra.get(QAT_KEY, False))
    return model, opt, extra


# ------------------------------------------------------------------ training
def train_on_table(model: K3ForCausalLM, optimizer: torch.optim.Optimizer, table: pa.Table, cfg: GRPOConfig,
                   pad_id: int, micro_batch: int | None = None) -> dict:
    """One GRPO step over the whole scored batch (sequences with zero advantage carry no signal and
    are skipped; a batch where every group is uniform is a no-op step)."""
    n_moe, k = len(model.moe_layer_ids), model.config.num_experts_per_token
    seqs = [s for s in table_to_sequences(table, n_moe, k) if s.advantage != 0.0]
    if not seqs:
        return {"skipped": 1.0, "sequences": 0}
    m = grpo_train_step(model, optimizer, seqs, cfg, pad_id)
    m["sequences"] = len(seqs)
    m["skipped"] = 0.0
    return m


def supervised_warmup(model: K3ForCausalLM, env, env_spec: str, tok: ByteTokenizer, steps: int, batch_size: int,
                      lr: float, seed: int, log=None) -> dict:
    """Teach the answer format from ``env.reference`` on training prompts (never held-out ones)."""
    from k3core.rl.data import training_prompts

    if not hasattr(env, "reference"):
        raise ValueError(f"environment {env_spec!r} has no reference(prompt) method: run with --warmup-steps 0")
    torch.manual_seed(seed)
    opt = make_optimizer(model, lr)
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        prompts = training_prompts(env, seed + 7919, step, batch_size, env_spec)
        seqs = [RLSequence(tok.encode(p), tok.encode(env.reference(p), bos=False) + [tok.eos_id]) for p in prompts]
        losses.append(sft_step(model, opt, seqs, tok.pad_id)["loss"])
        if log and (step % 10 == 0 or step == steps - 1):
            log(f"warm-up step {step + 1}/{steps}: loss {losses[-1]:.3f}")
    return {"warmup_steps": steps, "warmup_loss_first": losses[0] if losses else None,
            "warmup_loss_last": losses[-1] if losses else None, "warmup_seconds": time.perf_counter() - t0}
