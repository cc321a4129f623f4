"""Run settings, in sections: model and source, rollout, GRPO (the trainer), warm-up, evaluation,
pipeline, reward (the sandbox), scale-out, device. ``RLSettings`` composes them. The defaults live here and only here: the CLI flags, the
Prefect deployments' parameters and the stages all read these objects.

Every section validates itself in ``__post_init__`` and raises one ``SettingsError`` listing every
problem it found; ``RLSettings.from_dict`` builds all sections first and reports the problems of all
of them at once. Prefect validates flow parameters by constructing these dataclasses (pydantic calls
``__post_init__``), so a deployment run with a bad parameter fails before any stage runs with the
same message the CLI prints. Unknown keys are refused (``extra="forbid"``) rather than ignored: a
misspelt setting must not silently fall back to its default.

Each field has one command-line flag, named in its metadata (``flag``); flag names are unique across
sections, so ``RLSettings.from_flat`` maps flags (or their underscore forms) back to sections.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DECODE_MODES", "DEVICES", "DeviceSettings", "EvalSettings", "GRPOSettings", "LOSS_AGGREGATIONS", "ModelSettings", "PipelineSettings", "RLSettings",
           "RewardSettings", "RolloutSettings", "ScaleOutSettings", "SettingsError", "TASK_RUNNERS", "WarmupSettings"]

# pydantic (through Prefect) reads this attribute of stdlib dataclasses: refuse unknown keys.
_FORBID_EXTRA = {"extra": "forbid"}


class SettingsError(ValueError):
    """Invalid settings; the message lists every problem."""

    def __init__(self, where: str, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        n = len(self.problems)
        super().__init__(f"invalid {where} ({n} problem{'s' if n > 1 else ''}):\n{lines}")


def _flag(name: str, help: str) -> dict:
    return {"flag": name, "help": help}


def _check(problems: list[str], section: _Section) -> None:
    """Type and sign checks shared by every section: ints are ints (not bools), floats are finite
    numbers (NaN compares false with every bound, so it would pass the range checks and reach the
    trainer), bools are bools, strings are strings, and fields marked ``min`` are at least that."""
    for f in dataclasses.fields(section):
        v, flag = getattr(section, f.name), f.metadata.get("flag", f.name)
        kind = f.metadata.get("kind")
        if kind == "int" and (isinstance(v, bool) or not isinstance(v, int)):
            problems.append(f"--{flag} must be an integer, got {v!r}")
            continue
        if kind == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))):
            problems.append(f"--{flag} must be a number, got {v!r}")
            continue
        if kind == "float" and not math.isfinite(v):
            problems.append(f"--{flag} must be a finite number, got {v!r}")
            continue
        if kind == "bool" and not isinstance(v, bool):
            problems.append(f"--{flag} must be true or false, got {v!r}")
            continue
        if kind == "str" and not isinstance(v, str):
            problems.append(f"--{flag} must be a string, got {v!r}")
            continue
        lo = f.metadata.get("min")
        if lo is not None and v is not None and v < lo:
            problems.append(f"--{flag} must be >= {lo}, got {v!r}")


def _int(default: int, flag: str, help: str, min: int | None = 0) -> Any:
    return field(default=default, metadata={**_flag(flag, help), "kind": "int", "min": min})


def _float(default: float, flag: str, help: str, min: float | None = None) -> Any:
    return field(default=default, metadata={**_flag(flag, help), "kind": "float", "min": min})


def _bool(default: bool, flag: str, help: str) -> Any:
    return field(default=default, metadata={**_flag(flag, help), "kind": "bool"})


def _str(default: str, flag: str, help: str) -> Any:
    return field(default=default, metadata={**_flag(flag, help), "kind": "str"})


class _Section:
    __pydantic_config__ = _FORBID_EXTRA

    def problems(self) -> list[str]:
        out: list[str] = []
        _check(out, self)
        return out

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise SettingsError(f"{type(self).__name__}", problems)


@dataclass
class ModelSettings(_Section):
    """The model and where its weights come from."""

    preset: str = _str("small", "preset", "model preset: tiny, small, medium or full")
    source: str = _str("", "source", "checkpoint URL (file://, memory://, s3://, hf://) or init:PRESET[:SEED[:TOKENIZER]] "
                       "(TOKENIZER bytes, the default, or bpe: the bundled BPE with K3's special tokens and chat "
                       "template); empty: a fresh seeded checkpoint of the preset (init:PRESET:SEED, with :bpe for medium "
                       "and full, whose vocabulary is the release's)")

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.preset, str):
            from k3core.config import PRESETS

            if self.preset not in PRESETS:
                out.append(f"--preset: unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if isinstance(self.source, str) and self.source.startswith("init:"):
            from k3core.config import PRESETS

            parts = self.source.split(":")
            if (len(parts) not in (2, 3, 4) or parts[1] not in PRESETS or (len(parts) >= 3 and not parts[2].isdigit())
                    or (len(parts) == 4 and parts[3] not in ("bytes", "bpe"))):
                out.append(f"--source {self.source!r}: expected init:PRESET[:SEED[:TOKENIZER]] with PRESET one of "
                           f"{sorted(PRESETS)}, SEED a non-negative integer and TOKENIZER bytes or bpe")
        return out


# The rollout engine's decode modes (k3core.rollout.engine); "auto" follows the device (k3core.device.decode_mode).
DECODE_MODES = ("auto", "dynamic", "static", "graph")
# What a weight update does to the sequences in flight (k3core.rollout.engine.RolloutEngine.load_weights)
IN_FLIGHT = ("drain", "continue", "abort")
PROMPT_FORMATS = ("auto", "chat", "raw")  # k3core.rl.prompting


@dataclass
class RolloutSettings(_Section):
    """Sampling: how many completions per iteration, how they are sampled, on which engine."""

    prompts_per_iteration: int = _int(16, "prompts-per-iteration", "prompts sampled per RL iteration", min=1)
    samples_per_prompt: int = _int(8, "samples-per-prompt", "completions per prompt (the GRPO group)", min=1)
    max_new_tokens: int = _int(7, "max-new-tokens", "completion length cap (per assistant turn of an agentic episode)",
                               min=1)
    max_turns: int = _int(8, "max-turns", "assistant turns per episode of an agentic environment (one with tools)",
                          min=1)
    max_episode_tokens: int = _int(512, "max-episode-tokens", "tokens after the prompt per agentic episode: the "
                                   "assistant turns and the tool results between them", min=1)
    tool_timeout: float = _float(10.0, "tool-timeout", "wall seconds of one tool call of an agentic environment "
                                 "(user environments' tools run in the reward sandbox; one past it becomes an "
                                 "error result the model sees)", min=0.001)
    temperature: float = _float(1.0, "temperature", "sampling temperature (the trainer uses the same one)", min=0.0)
    top_p: float = _float(1.0, "top-p", "nucleus sampling mass, in (0, 1]")
    quantized: bool = _bool(True, "quantized-rollouts", "W4A8 engine (MXFP4 routed experts, FP8 activations)")
    url: str = _str("local", "rollout-url", "'local' (embedded engine) or a rollout server URL "
                    "(k3rl rollout-server, SGLang)")
    decode: str = _str("auto", "decode", "the embedded engine's decode mode: auto (static on cuda, dynamic on cpu), "
                       "dynamic, static, or graph (cuda only: each batch bucket's decode step replayed as a CUDA graph, "
                       "the fast one; not yet the default, docs/results/gpu_tests.md)")
    in_flight: str = _str("drain", "in-flight", "what a weight update does to the batch sampled ahead under "
                          "--max-staleness while it is still generating: drain (it finishes on the old weights, the "
                          "update waits), continue (its sequences go on with the new weights from the next token, on "
                          "the decode state the old ones computed) or abort (its running sequences are sampled again "
                          "whole by the new weights)")

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.in_flight, str) and self.in_flight not in IN_FLIGHT:
            out.append(f"--in-flight: unknown choice {self.in_flight!r}; choose one of {', '.join(IN_FLIGHT)}")
        if isinstance(self.decode, str) and self.decode not in DECODE_MODES:
            out.append(f"--decode: unknown decode mode {self.decode!r}; choose one of {', '.join(DECODE_MODES)}")
        if isinstance(self.top_p, (int, float)) and math.isfinite(self.top_p) and not 0.0 < self.top_p <= 1.0:
            out.append(f"--top-p must lie in (0, 1], got {self.top_p!r}")
        if isinstance(self.url, str) and self.url not in ("", "local") and not self.url.startswith(("http://", "https://")):
            out.append(f"--rollout-url {self.url!r}: use 'local' or an http(s):// URL")
        return out


# How the per-token GRPO losses of a minibatch add up (k3core.rl.grpo.loss_weights).
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-sum")
# Rollout correction (k3core/rl/correction.py): the importance weight's level and the rejection's.
IS_LEVELS = ("token", "sequence", "none")
RS_LEVELS = ("none", "token", "sequence", "geometric")


@dataclass
class GRPOSettings(_Section):
    """The trainer's update: GRPO with asymmetric PPO clipping, truncated importance sampling against
    the rollout engine's log-probabilities, routing replay, optional MXFP4 QAT of routed experts."""

    lr: float = _float(2e-4, "lr", "learning rate of the RL updates", min=0.0)
    clip_eps_low: float = _float(0.2, "clip-eps-low", "PPO clip below: ratio >= 1 - eps_low", min=0.0)
    clip_eps_high: float = _float(0.28, "clip-eps-high", "PPO clip above: ratio <= 1 + eps_high", min=0.0)
    tis_cap: float = _float(2.0, "tis-cap", "cap of the truncated importance weight min(p_trainer/p_rollout, cap), "
                            "which corrects the rollout engine's mismatch (> 0)")
    rollout_is: str = _str("token", "rollout-is", "importance weight against the rollout engine, truncated at "
                           "--tis-cap: token (min(rho_t, cap), TIS), sequence (min(prod rho, cap) for every token "
                           "of the sequence) or none (k3core/rl/correction.py)")
    rollout_rs: str = _str("none", "rollout-rs", "rejection of tokens whose rollout ratio leaves [--rs-low, "
                           "--rs-high]: none, token (IcePop-style), sequence (the product of the sequence's "
                           "ratios, MIS) or geometric (their geometric mean); rejected tokens leave the loss mask")
    rs_low: float = _float(0.5, "rs-low", "lower end of --rollout-rs's band (0: upper bound only)", min=0.0)
    rs_high: float = _float(2.0, "rs-high", "upper end of --rollout-rs's band", min=0.0)
    max_grad_norm: float = _float(1.0, "max-grad-norm", "gradient clipping norm", min=0.0)
    routing_replay: bool = _bool(True, "routing-replay", "train through the experts the rollout engine chose")
    qat: bool = _bool(False, "qat", "MXFP4 fake-quantised routed experts in the trainer (straight-through); saved "
                      "with each trainer state, and a resume with the other setting is refused")
    ppo_epochs: int = _int(1, "ppo-epochs", "passes over each rollout batch (logp_old is taken once, before the "
                           "first update, so later updates are off-policy and the PPO clip engages)", min=1)
    minibatches: int = _int(1, "minibatches", "optimizer steps per pass: the rollout batch is shuffled and split into "
                            "this many minibatches (updates per iteration = ppo-epochs x minibatches)", min=1)
    lr_warmup_steps: int = _int(0, "lr-warmup-steps", "optimizer steps over which the learning rate rises linearly "
                                "to --lr (counted by the trainer state, so a resumed run continues the ramp): the "
                                "first Adam steps move every weight by about lr whatever its gradient, which "
                                "undoes a warmed-up policy at full lr (0: no ramp)")
    micro_batch_tokens: int = _int(8192, "micro-batch-tokens", "token budget of one forward/backward (real tokens when "
                                   "packing, sequences x padded length otherwise); gradients accumulate over a "
                                   "minibatch's micro-batches, so the update does not depend on it (0: a whole "
                                   "minibatch at once)")
    packing: bool = _bool(True, "packing", "pack each micro-batch's sequences back to back into one row (varlen: "
                          "cu_seqlens for KDA, block-diagonal causal attention for MLA), filled first-fit-decreasing "
                          "under --micro-batch-tokens, so no position is padding; false: right-padded [B, L] "
                          "micro-batches with an attention mask. Same update either way, up to rounding")
    loss_aggregation: str = _str("token-mean", "loss-aggregation", "token-mean (every token counts the same, DAPO), "
                                 "seq-mean-token-mean (every sequence counts the same) or seq-sum (token sum over "
                                 "sequences x --max-new-tokens, Dr. GRPO)")
    scale_advantages: bool = _bool(True, "scale-advantages", "divide advantages by their group's reward std (GRPO); "
                                   "false: reward minus the group mean only (Dr. GRPO)")
    refill_rounds: int = _int(0, "refill-rounds", "dynamic sampling: groups whose rewards are all equal are always "
                              "dropped; while fewer than --prompts-per-iteration groups differ, sample up to this many "
                              "extra rounds of new prompts (0: no refill)")
    kl_coef: float = _float(0.0, "kl-coef", "coefficient of the KL penalty to the frozen reference policy (the run's "
                            "starting weights: warmed up, or the source checkpoint), k3 estimator per token; its "
                            "logprobs come from a stage of their own (0: off)", min=0.0)
    max_staleness: int = _int(0, "max-staleness", "K: iteration N trains on a batch sampled by version max(0, N-K), "
                              "each batch sampled K iterations ahead beside the train steps (0: synchronous; 1: "
                              "one-step-off-policy); the rollout correction (--rollout-is, --rollout-rs) weighs the "
                              "lag")

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.loss_aggregation, str) and self.loss_aggregation not in LOSS_AGGREGATIONS:
            out.append(f"--loss-aggregation: unknown mode {self.loss_aggregation!r}; choose one of "
                       f"{', '.join(LOSS_AGGREGATIONS)}")
        if isinstance(self.tis_cap, (int, float)) and math.isfinite(self.tis_cap) and not self.tis_cap > 0:
            out.append(f"--tis-cap must be > 0, got {self.tis_cap!r}")
        if isinstance(self.rollout_is, str) and self.rollout_is not in IS_LEVELS:
            out.append(f"--rollout-is {self.rollout_is!r}: choose one of {', '.join(IS_LEVELS)}")
        if isinstance(self.rollout_rs, str) and self.rollout_rs not in RS_LEVELS:
            out.append(f"--rollout-rs {self.rollout_rs!r}: choose one of {', '.join(RS_LEVELS)}")
        if (isinstance(self.rs_low, (int, float)) and isinstance(self.rs_high, (int, float))
                and not self.rs_low < self.rs_high):
            out.append(f"--rs-low {self.rs_low!r} must be below --rs-high {self.rs_high!r}")
        if isinstance(self.clip_eps_low, (int, float)) and self.clip_eps_low >= 1:
            out.append(f"--clip-eps-low must be < 1 (the ratio's lower bound is 1 - eps), got {self.clip_eps_low!r}")
        if (isinstance(self.max_staleness, int) and isinstance(self.refill_rounds, int) and self.max_staleness > 1
                and self.refill_rounds):
            out.append(f"--max-staleness {self.max_staleness} with --refill-rounds {self.refill_rounds}: a batch sampled "
                       f"{self.max_staleness} iterations ahead starts at a data position that the refill rounds of the "
                       "batches before it have not fixed yet; use --max-staleness 0 or 1 with refills, or "
                       "--refill-rounds 0")
        return out


# Copy sequences per copy step of the warm-up, per reference sequence of a reference step: a copy
# sequence is a few dozen tokens where a reference episode is a few hundred (k3core.rl.warmup).
COPY_BATCH_FACTOR = 4


@dataclass
class WarmupSettings(_Section):
    """Supervised warm-up on the environment's reference answers before RL (needs ``reference``),
    after an optional copy phase (``k3core.rl.warmup``)."""

    steps: int = _int(25, "warmup-steps", "supervised steps (0: no warm-up)")
    batch: int = _int(32, "warmup-batch", "sequences per warm-up step", min=1)
    lr: float = _float(1e-3, "warmup-lr", "warm-up learning rate", min=0.0)
    copy_steps: int = _int(0, "warmup-copy-steps", f"steps repeating short texts of the environment's training prompts back (what its copied(prompt) "
                           f"says its episodes copy, else the prompt; {COPY_BATCH_FACTOR}x --warmup-batch each) before the "
                           "reference steps: teaches a model trained "
                           "from scratch to copy, which agentic episodes need (tool arguments, tool results); a "
                           "pretrained checkpoint needs none")

    def runs(self) -> bool:
        return self.steps > 0 or self.copy_steps > 0


@dataclass
class EvalSettings(_Section):
    """Held-out evaluation and the train/inference mismatch metric."""

    prompts: int = _int(128, "eval-prompts", "held-out prompts per evaluation", min=1)
    every: int = _int(5, "eval-every", "evaluate every N iterations (0: only at the end)")
    mismatch_sequences: int = _int(16, "mismatch-sequences", "rollouts per iteration for KL(trainer || W4A8 engine) "
                                   "vs KL(trainer || float engine) (0: off)")
    mismatch_every: int = _int(5, "mismatch-every", "measure the mismatch every N iterations, from iteration 0 "
                               "(it builds two extra engines from a copy of the trainer and decodes the sampled "
                               "rollouts through both, token by token: a tenth of a small run when measured every "
                               "iteration, docs/results/rl_defaults.md)", min=1)

    def due(self, iteration: int) -> bool:
        return bool(self.every) and iteration % self.every == 0

    def mismatch_due(self, iteration: int) -> bool:
        return bool(self.mismatch_sequences) and iteration % self.mismatch_every == 0


@dataclass
class RewardSettings(_Section):
    """Where user reward code runs: environments given as ``module.path:factory`` and dataset
    environments score in sandbox workers (``k3core.rl.sandbox``), one confined process per call;
    the built-ins (add, reverse) score in process."""

    timeout: float = _float(5.0, "reward-timeout", "wall seconds of one sandboxed reward call; past it the call is "
                            "killed and its reward is 0 (reason in scored.parquet)")
    workers: int = _int(2, "reward-workers", "sandbox worker processes (reward calls in parallel)", min=1)
    memory_mb: int = _int(1024, "reward-memory-mb", "address-space limit of each process of a reward call (MiB)",
                          min=64)
    max_processes: int = _int(8, "reward-max-processes", "processes a reward call may have at once, itself included",
                              min=1)

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and not self.timeout > 0:
            out.append(f"--reward-timeout must be a positive number of seconds, got {self.timeout!r}")
        return out


@dataclass
class PipelineSettings(_Section):
    """Which run, where its artifacts go, how long it runs, on which environment."""

    run_id: str = _str("demo", "run-id", "the run; re-using a run id resumes that run")
    artifacts: str = _str("./artifacts", "artifacts", "artifact root: a path or fsspec URL")
    iterations: int = _int(30, "iterations", "RL iterations")
    env: str = _str("reverse", "env", "built-in environment (add, reverse; tools-calc: multi-turn tool calls), a "
                    "dataset with its verifier (dataset:math:URL, dataset:code:URL; math and code: the bundled ones) or module.path:factory")
    prompt_format: str = _str("auto", "prompt-format", "how prompts are written: chat (a system and a user turn in "
                              "the checkpoint's chat template; completions end at <|im_end|>), raw (the prompt text), "
                              "or auto (chat where the checkpoint's tokenizer has a chat template, else raw)")
    seed: int = _int(0, "seed", "seed of prompts, sampling and a fresh checkpoint")
    keep_checkpoints: int = _int(1, "keep-checkpoints", "keep the newest N checkpoints (trainer states) of the "
                                 "run and delete older ones after each iteration; resume's own always stay "
                                 "(0: keep all)")
    save_every: int = _int(1, "save-every", "write the trainer state (a checkpoint) every K iterations and after "
                           "the last; in between the live trainer carries on, and a resume re-runs the train steps "
                           "since the last checkpoint from the published rollout and score tables", min=1)
    tensorboard: str = _str("", "tensorboard", "write TensorBoard event files of each iteration's metrics under "
                            "DIR/<run id> (empty: off; needs pip install 'k3rl[trackers]')")
    mlflow_uri: str = _str("", "mlflow-uri", "log each iteration's metrics to an MLflow run at this tracking URI "
                           "(sqlite:///path/mlflow.db, http://127.0.0.1:5000; empty: off; needs "
                           "pip install 'k3rl[trackers]')")
    mlflow_experiment: str = _str("k3rl", "mlflow-experiment", "the MLflow experiment of --mlflow-uri's runs "
                                  "(one MLflow run per run id, found again on resume)")

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.run_id, str):
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", self.run_id):
                out.append(f"--run-id {self.run_id!r}: use letters, digits, '.', '_' and '-' (no path separators, "
                           "not starting with '.' or '-', at most 128 characters)")
        if isinstance(self.env, str) and not self.env:
            out.append("--env is empty: use a built-in (add, reverse) or module.path:factory")
        if isinstance(self.prompt_format, str) and self.prompt_format not in PROMPT_FORMATS:
            out.append(f"--prompt-format {self.prompt_format!r}: choose one of {', '.join(PROMPT_FORMATS)}")
        return out


TASK_RUNNERS = ("local", "dask", "ray")


@dataclass
class ScaleOutSettings(_Section):
    """Beyond one process: the Prefect task runner that fans rollout shards out over resident engine
    workers (and sandboxed reward calls over the same workers), and the number of torchrun processes
    of the train stage (FSDP2)."""

    task_runner: str = _str("local", "task-runner", "local (every stage in this process), dask (rollout shards on "
                            "--rollout-workers resident engine workers of a Dask cluster) or ray (on as many engine "
                            "actors of a Ray cluster); both also spread sandboxed reward calls over their workers")
    dask_address: str = _str("", "dask-address", "scheduler address of an existing Dask cluster (tcp://host:port); "
                             "empty: a LocalCluster of --rollout-workers single-threaded processes on this machine")
    ray_address: str = _str("", "ray-address", "address of an existing Ray cluster (host:port of its head, ray://host:"
                            "port for Ray Client, or auto); empty: a local Ray instance of --rollout-workers CPUs")
    rollout_workers: int = _int(1, "rollout-workers", "rollout shards per iteration (with --task-runner dask or ray: "
                                "the resident engine workers)", min=1)
    train_procs: int = _int(1, "train-procs", "processes of the train stage: > 1 runs it as a torchrun job, the "
                            "model sharded with FSDP2 (gloo on CPU, NCCL on GPUs)", min=1)

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.task_runner, str) and self.task_runner not in TASK_RUNNERS:
            out.append(f"--task-runner: unknown runner {self.task_runner!r}; choose one of {', '.join(TASK_RUNNERS)}")
        if isinstance(self.dask_address, str) and self.dask_address:
            if self.task_runner != "dask":
                out.append("--dask-address needs --task-runner dask")
            if not self.dask_address.startswith(("tcp://", "tls://", "inproc://", "ucx://")):
                out.append(f"--dask-address {self.dask_address!r}: use a scheduler address such as tcp://127.0.0.1:8786")
        if isinstance(self.ray_address, str) and self.ray_address:
            if self.task_runner != "ray":
                out.append("--ray-address needs --task-runner ray")
            if self.ray_address != "auto" and not re.fullmatch(r"(ray://)?[A-Za-z0-9.\-\[\]:]+:\d+", self.ray_address):
                out.append(f"--ray-address {self.ray_address!r}: use HOST:PORT of the head node (127.0.0.1:6379), "
                           "ray://HOST:PORT (Ray Client) or auto")
        if isinstance(self.rollout_workers, int) and self.rollout_workers > 1 and self.task_runner == "local":
            out.append(f"--rollout-workers {self.rollout_workers} needs --task-runner dask or ray (the local runner has "
                       "one engine, in the flow's process)")
        return out


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class DeviceSettings(_Section):
    """Where the stages compute: every stage of the run (warm-up, quantize, rollout engine, mismatch,
    reference, train step, weight transfer, evaluation) puts its tensors on this one device; on a GPU
    the trainer and the rollout engine share it. Which device ``auto`` means, and whether ``cuda`` is
    there, is decided when the run starts (``k3core.device.resolve_device``), not here: settings
    recorded on a GPU machine still load on a CPU one."""

    type: str = _str("auto", "device", "cpu, cuda (refused where torch sees no GPU) or auto (cuda when "
                     "torch.cuda.is_available(), else cpu)")
    dtype: str = _str("auto", "dtype", "the weights' dtype in the trainer and the rollout engine: float32, bfloat16 "
                      "or auto (bfloat16 on cuda: tensor cores and fla's shipped kernel configs; float32 on cpu). "
                      "The trainer's master weights stay float32 on the host either way (StreamedAdamW)")

    def problems(self) -> list[str]:
        out = super().problems()
        if isinstance(self.type, str) and self.type not in DEVICES:
            out.append(f"--device: unknown device {self.type!r}; choose one of {', '.join(DEVICES)}")
        if isinstance(self.dtype, str) and self.dtype not in DTYPES:
            out.append(f"--dtype: unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        return out


_SECTIONS: dict[str, type[_Section]] = {"model": ModelSettings, "rollout": RolloutSettings, "grpo": GRPOSettings,
                                        "warmup": WarmupSettings, "evaluation": EvalSettings,
                                        "pipeline": PipelineSettings, "reward": RewardSettings, "scale_out": ScaleOutSettings,
                                        "device": DeviceSettings}



def default_source(preset: str, seed: int) -> str:
    """The fresh checkpoint a run starts from when ``--source`` is not given: the preset's, seeded,
    with the byte tokenizer where its vocabulary is the byte one (tiny, small) and the bundled K3
    BPE where it is the release's (medium, full), so its prompts can be written either way."""
    from k3core.config import PRESETS, K3Config
    from k3core.tokenizer import is_byte_vocabulary

    bytes_vocab = preset in PRESETS and is_byte_vocabulary(K3Config.preset(preset))
    return f"init:{preset}:{seed}" if bytes_vocab or preset not in PRESETS else f"init:{preset}:{seed}:bpe"


@dataclass
class RLSettings:
    """Everything a run needs, by section. ``model.source`` empty means ``init:<preset>:<seed>``."""

    __pydantic_config__ = _FORBID_EXTRA

    model: ModelSettings = field(default_factory=ModelSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    warmup: WarmupSettings = field(default_factory=WarmupSettings)
    evaluation: EvalSettings = field(default_factory=EvalSettings)
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    scale_out: ScaleOutSettings = field(default_factory=ScaleOutSettings)
    device: DeviceSettings = field(default_factory=DeviceSettings)

    def __post_init__(self) -> None:
        problems = []
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                problems.append(f"section {name!r} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if problems:
            raise SettingsError("RLSettings", problems)
        cross = []
        runner = self.scale_out.task_runner
        if runner in ("dask", "ray") and self.rollout.url not in ("", "local"):
            cross.append(f"--task-runner {runner} runs rollouts on the {runner.capitalize()} workers' own engines; "
                         f"it cannot be combined with --rollout-url {self.rollout.url}")
        if runner in ("dask", "ray") and self.rollout.in_flight != "drain":
            cross.append(f"--in-flight {self.rollout.in_flight} updates this process's engine between two decode "
                         f"steps; with --task-runner {runner} the batch sampled ahead runs on the workers' engines, "
                         "each at the version its shard names: use --in-flight drain there")
        if self.rollout.in_flight != "drain" and not self.grpo.max_staleness:
            cross.append(f"--in-flight {self.rollout.in_flight} acts on the batch sampled ahead while a weight update "
                         "arrives, and with --max-staleness 0 none is: use --max-staleness 1 or more (or --in-flight "
                         "drain)")
        if self.rollout.in_flight != "drain" and self.rollout.url not in ("", "local"):
            cross.append(f"--in-flight {self.rollout.in_flight} updates the embedded engine between two decode steps; "
                         f"a rollout server (--rollout-url {self.rollout.url}) takes its updates between batches: "
                         "use --rollout-url local, or --in-flight drain")
        if self.model.source.startswith("init:") and self.model.source.split(":")[1] != self.model.preset:
            cross.append(f"--source {self.model.source} makes a '{self.model.source.split(':')[1]}' checkpoint but "
                         f"--preset is '{self.model.preset}' (the run validates its checkpoint against the preset): "
                         f"use --source init:{self.model.preset}[:SEED], or leave --source out")
        if self.scale_out.train_procs > 1 and self.grpo.kl_coef:
            cross.append("--kl-coef with --train-procs > 1: the FSDP2 train step does not read the reference's "
                         "logprobs yet (use --train-procs 1, or --kl-coef 0)")
        if self.device.type == "cuda" and runner in ("dask", "ray"):
            cross.append(f"--device cuda with --task-runner {runner}: the {runner.capitalize()} workers' resident engines "
                         "run on the CPU; use --task-runner local to sample on the GPU")
        if self.rollout.decode == "graph" and self.device.type == "cpu":
            cross.append("--decode graph replays CUDA graphs: use it with --device cuda (or auto on a GPU machine), "
                         "or --decode auto on the CPU")
        if self.device.type == "cuda" and self.scale_out.train_procs > 1:
            cross.append("--device cuda with --train-procs > 1: the FSDP2 train job runs on gloo (CPU) only; "
                         "use --train-procs 1 on one GPU")
        if self.device.dtype == "bfloat16" and self.scale_out.train_procs > 1:
            cross.append("--dtype bfloat16 with --train-procs > 1: FSDP2 shards parameters of one dtype, and the bf16 "
                         "model keeps KDA's A_log and dt_bias in fp32; use --dtype float32 (or auto on the CPU)")
        if self.pipeline.save_every > 1 and (runner in ("dask", "ray") or self.scale_out.train_procs > 1):
            cross.append(f"--save-every {self.pipeline.save_every} keeps the trainer live in this process between "
                         "checkpoints, but " + (f"--task-runner {runner}'s workers" if runner in ("dask", "ray") else
                                                "--train-procs > 1's ranks") + " read every iteration's trainer "
                         "state from disk: use --save-every 1 with them")
        if cross:
            raise SettingsError("RLSettings", cross)
        if not self.model.source:
            self.model.source = default_source(self.model.preset, self.pipeline.seed)

    # ----------------------------------------------------------------------------- building
    @classmethod
    def from_dict(cls, data: dict[str, Any] | None = None) -> RLSettings:
        """From nested sections (``{"rollout": {"temperature": 0.7}}``, as deployments pass them) or
        flat field names / flags (``{"temperature": 0.7}``, ``{"rollout-url": ...}``), or both. Every
        problem of every section is reported in one ``SettingsError``."""
        data = dict(data or {})
        nested: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        flat = flag_index()
        problems = []
        for key, value in data.items():
            if key in _SECTIONS and isinstance(value, dict):
                nested[key].update(value)
            elif key.replace("-", "_") in flat or key in flat:
                sec, fname = flat.get(key) or flat[key.replace("-", "_")]
                nested[sec][fname] = value
            else:
                problems.append(f"unknown setting {key!r}: sections are {sorted(_SECTIONS)}; "
                                f"flat names are the flags of `k3rl run --help`")
        sections = {}
        for name, section in _SECTIONS.items():
            known = {f.name for f in dataclasses.fields(section)}
            unknown = sorted(set(nested[name]) - known)
            if unknown:
                problems.append(f"section {name!r} has no setting {', '.join(map(repr, unknown))} "
                                f"(it has {', '.join(sorted(known))})")
            try:
                sections[name] = section(**{k: v for k, v in nested[name].items() if k in known})
            except SettingsError as e:
                problems += e.problems
        if problems:
            raise SettingsError("settings", problems)
        return cls(**sections)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def replace(self, **flat: Any) -> RLSettings:
        """A copy with settings changed by flat name (``s.replace(iterations=3, run_id="x")``)."""
        d = self.to_dict()
        index = flag_index()
        for k, v in flat.items():
            if k not in index:
                raise SettingsError("settings", [f"unknown setting {k!r}"])
            sec, fname = index[k]
            d[sec][fname] = v
        return RLSettings.from_dict(d)


def flag_index() -> dict[str, tuple[str, str]]:
    """flat name (the flag with '_' for '-', and the flag itself) -> (section, field)."""
    out: dict[str, tuple[str, str]] = {}
    for sec, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            flag = f.metadata["flag"]
            out[flag.replace("-", "_")] = (sec, f.name)
            out[flag] = (sec, f.name)
    return out


def section_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section, field) for every setting, in section order (the CLI builds its flags from these)."""
    return [(sec, f) for sec, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]
