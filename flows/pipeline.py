"""The RL pipeline as Prefect flows: ``prepare`` (fetch, validate, warm-up, quantize), ``rl_iteration``
(rollout, score, train, save, transfer) and ``rl_run`` (prepare + N iterations + reports).

Every stage is a task (``tasks/``) that publishes its artifacts atomically under
``<artifacts>/runs/<run_id>/`` and is cached on its inputs and source, so re-running ``rl_run`` with
the same run id resumes after the last finished stage: nothing finished is recomputed, no rollout
batch is lost. Data path of one iteration N (engine at weight version N):

    rollout(engine@N) -> rollouts.parquet -> score -> scored.parquet -> train_step(state N) -> state N+1
    -> save_checkpoint (manifest, latest) -> transfer_weights (MXFP4 experts) -> engine@N+1
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from prefect import flow, get_run_logger

from flows import reports
from tasks.common import stage
from tasks.evaluate import evaluate
from tasks.fetch import fetch_checkpoint
from tasks.mismatch import rollout_mismatch
from tasks.quantize import quantize_mxfp4
from tasks.rollout import rollout
from tasks.save import save_checkpoint
from tasks.score import score_rewards
from tasks.train import train_step
from tasks.transfer import transfer_weights
from tasks.validate import validate_checkpoint
from tasks.warmup import warmup


@dataclass
class RLSettings:
    """Typed run settings (the flow parameters a deployment exposes)."""

    preset: str = "small"
    source: str = "init:small:0"
    env: str = "reverse"
    iterations: int = 30
    artifacts: str = "./artifacts"
    run_id: str = "demo"
    seed: int = 0
    prompts_per_iteration: int = 16
    samples_per_prompt: int = 8
    max_new_tokens: int = 7
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 2e-4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    tis_cap: float = 2.0
    routing_replay: bool = True
    quantized_rollouts: bool = True
    warmup_steps: int = 25
    warmup_batch: int = 32
    warmup_lr: float = 1e-3
    eval_prompts: int = 128
    eval_every: int = 5
    # per-iteration KL(trainer || W4A8 engine) vs KL(trainer || float engine) on this many rollouts (0: off)
    mismatch_sequences: int = 16
    # MXFP4 fake-quant (straight-through) of routed-expert weights in the RL trainer (K3Config.qat_routed_experts);
    # saved with each trainer state, never in config.json or the exported weights
    qat: bool = False
    # the engine of the rollout and evaluation stages: "local" (embedded) or a rollout server URL (k3rl serve, SGLang)
    rollout_url: str = "local"


def _run_prefix(s: RLSettings) -> str:
    return f"runs/{s.run_id}"


@flow(name="prepare", flow_run_name="{settings.run_id}-prepare", log_prints=True)
def prepare(settings: RLSettings) -> dict:
    """fetch -> validate -> (supervised warm-up) -> quantize (MXFP4 rollout weights, version 0)."""
    s, root, pre = settings, settings.artifacts, _run_prefix(settings)
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    ckpt = stage(fetch_checkpoint, name="fetch_checkpoint", artifact_root=root,
                 outputs=[_uri(root, f"{pre}/source")])(s.source, root, f"{pre}/source")
    t["fetch"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = stage(validate_checkpoint, name="validate_checkpoint", artifact_root=root,
                   outputs=[_uri(root, f"{pre}/source.validation.json")], inputs=[ckpt["uri"]])(
        ckpt, root, f"{pre}/source.validation.json", s.preset)
    t["validate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    policy = ckpt | {"kind": "hf", "version": 0}
    if s.warmup_steps > 0:
        policy = stage(warmup, name="warmup", artifact_root=root, outputs=[_uri(root, f"{pre}/warmup")],
                       inputs=[ckpt["uri"]])(ckpt, s.env, s.warmup_steps, s.warmup_batch, s.warmup_lr, s.seed,
                                              root, f"{pre}/warmup")
    t["warmup"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    weights = policy | {"version": 0}
    if s.quantized_rollouts:
        weights = stage(quantize_mxfp4, name="quantize_mxfp4", artifact_root=root,
                        outputs=[_uri(root, f"{pre}/rollout-weights-v0")], inputs=[policy["uri"]])(
            policy, root, f"{pre}/rollout-weights-v0")
    t["quantize"] = time.perf_counter() - t0
    return {"checkpoint": ckpt, "report": report, "policy": policy, "weights": weights, "seconds": t}


@flow(name="rl_iteration", flow_run_name="{settings.run_id}-iter{iteration}", log_prints=True)
def rl_iteration(settings: RLSettings, iteration: int, state: dict, weights: dict) -> dict:
    """One iteration: rollout, score, train, save, transfer. Returns the next state and weights."""
    s, root = settings, settings.artifacts
    it = f"{_run_prefix(s)}/iter-{iteration:04d}"
    name = f"iter{iteration}"
    t: dict[str, float] = {}

    def timed(key, fn):
        t0 = time.perf_counter()
        out = fn()
        t[key] = time.perf_counter() - t0
        return out

    ev = None
    if s.eval_every and iteration % s.eval_every == 0:
        ev = timed("evaluate", lambda: stage(evaluate, name=f"evaluate-{name}", artifact_root=root, outputs=[],
                                              inputs=[weights["uri"]])(
            s.run_id, weights, s.env, s.eval_prompts, s.max_new_tokens, s.seed, s.temperature, s.rollout_url))
    ro = timed("rollout", lambda: stage(rollout, name=f"rollout-{name}", artifact_root=root,
                                         outputs=[_uri(root, f"{it}/rollouts.parquet")], inputs=[weights["uri"]])(
        s.run_id, iteration, weights, s.env, s.prompts_per_iteration, s.samples_per_prompt, s.max_new_tokens,
        s.temperature, s.top_p, s.seed, root, f"{it}/rollouts.parquet", s.rollout_url))
    mm = None
    if s.quantized_rollouts and s.mismatch_sequences:
        mm = timed("mismatch", lambda: stage(rollout_mismatch, name=f"rollout_mismatch-{name}", artifact_root=root,
                                              outputs=[], inputs=[ro["uri"], state["uri"]])(
            state, ro, s.mismatch_sequences, s.temperature, s.seed))
    sc = timed("score", lambda: stage(score_rewards, name=f"score_rewards-{name}", artifact_root=root,
                                       outputs=[_uri(root, f"{it}/scored.parquet")], inputs=[ro["uri"]])(
        ro, s.env, s.samples_per_prompt, root, f"{it}/scored.parquet"))
    tr = timed("train", lambda: stage(train_step, name=f"train_step-{name}", artifact_root=root,
                                       outputs=[_uri(root, f"{it}/trainer")], inputs=[sc["uri"], state["uri"]])(
        state, sc, iteration, s.lr, s.clip_eps_low, s.clip_eps_high, s.tis_cap, s.routing_replay, s.temperature,
        root, f"{it}/trainer", s.qat))
    ck_rel = f"{_run_prefix(s)}/checkpoints/iter-{iteration + 1:04d}"
    ck = timed("save", lambda: stage(save_checkpoint, name=f"save_checkpoint-{name}", artifact_root=root,
                                      outputs=[_uri(root, ck_rel)], inputs=[tr["uri"]])(
        tr, s.run_id, iteration + 1, root, ck_rel, f"{_run_prefix(s)}/latest.json"))
    new_weights = ck | {"quantized": s.quantized_rollouts}
    xf = timed("transfer", lambda: stage(transfer_weights, name=f"transfer_weights-{name}", artifact_root=root,
                                          outputs=[], inputs=[ck["uri"]], cache_policy=None, persist_result=False)(
        s.run_id, ck, s.quantized_rollouts))
    metrics = {"iteration": iteration, "weight_version": weights["version"], "qat": tr["qat"], **sc["stats"],
               **{k: v for k, v in tr["metrics"].items() if isinstance(v, (int, float))},
               "rollout_tokens": ro["tokens"], "transfer_seconds": xf["seconds"],
               **({k: v for k, v in ev.items() if k.startswith("heldout")} if ev else {}),
               **(mm or {}),
               **{f"seconds_{k}": v for k, v in t.items()}}
    lineage = [
        ("rollouts", ro["uri"], ro["sha256"], f"rollout-{name}", [weights["uri"]]),
        ("scored", sc["uri"], sc["sha256"], f"score_rewards-{name}", [ro["uri"]]),
        ("trainer state (QAT: MXFP4 routed experts)" if tr["qat"] else "trainer state", tr["uri"], tr["sha256"], f"train_step-{name}", [state["uri"], sc["uri"]]),
        ("checkpoint", ck["uri"], ck["sha256"], f"save_checkpoint-{name}", [tr["uri"]]),
        (f"engine weights v{ck['version']}", f"engine://{s.run_id}@v{xf['version']}", xf["sha256"],
         f"transfer_weights-{name}", [ck["uri"]]),
    ]
    return {"state": ck, "weights": new_weights, "metrics": metrics, "lineage": lineage}


@flow(name="rl_run", flow_run_name="{settings.run_id}", log_prints=True)
def rl_run(settings: RLSettings = RLSettings()) -> dict:
    """prepare, then ``iterations`` RL iterations (resuming a run id skips finished stages), then a
    final held-out evaluation and the run's reports (metrics table, lineage, curves, links)."""
    log = get_run_logger()
    s = settings
    t_start = time.perf_counter()
    prep = prepare(s)
    state, weights = prep["policy"], prep["weights"]
    history, lineage = [], []
    for n in range(s.iterations):
        out = rl_iteration(s, n, state, weights)
        state, weights = out["state"], out["weights"]
        history.append(out["metrics"])
        lineage += out["lineage"]
        m = out["metrics"]
        log.info(f"[{n + 1}/{s.iterations}] reward {m['reward_mean']:.3f} solved {m['solved_fraction']:.2f} "
                 f"KL(rollout||trainer) {m.get('kl_rollout_trainer_k3', 0):.4f}"
                 + (f" held-out {m['heldout_reward']:.3f}" if "heldout_reward" in m else ""))
        reports.publish_iteration(s, history, lineage, prep)
    final = stage(evaluate, name=f"evaluate-final", artifact_root=s.artifacts, outputs=[], inputs=[weights["uri"]])(
        s.run_id, weights, s.env, s.eval_prompts, s.max_new_tokens, s.seed, s.temperature, s.rollout_url)
    summary = reports.summary(s, prep, history, final, time.perf_counter() - t_start)
    reports.publish_iteration(s, history, lineage, prep, final=summary)
    return summary


def _uri(root: str, rel: str) -> str:
    from k3core.artifacts import ArtifactStore

    return ArtifactStore(root).uri(rel)
