"""warmup (optional first stage of RL): teach the answer format from the environment's reference
completions on training prompts (after the copy phase, where asked), then publish the policy in the
public bf16 layout."""

from __future__ import annotations

from prefect import get_run_logger

from k3core.artifacts import Artifact
from k3core.settings import WarmupSettings
from tasks.common import Run, progress_event, stage


def _rel(run: Run) -> str:
    return run.rel("warmup")


@stage(run_name="warmup", outputs=lambda run, **_: [run.uri(_rel(run))], inputs=lambda checkpoint, **_: [checkpoint.uri])
def warmup(run: Run, checkpoint: Artifact, settings: WarmupSettings) -> Artifact:
    """The supervised warm-up on the run's device; the published policy is the same public bf16 layout
    whatever the device."""
    from k3core.checkpoint.hf import save_hf, tokenizer_files
    from k3core.device import torch_dtype
    from k3core.rl.envs import load_env
    from k3core.rl.warmup import supervised_warmup
    from k3core.rl.weights import load_policy
    log = get_run_logger()
    metrics: dict = {"warmup_steps": settings.steps, "warmup_copy_steps": settings.copy_steps}

    def build(tmp):
        model = load_policy(checkpoint.path, torch_dtype(run.dtype), device=run.device)
        metrics.update(supervised_warmup(model, load_env(run.env), run.env, run.prompts(model.config, checkpoint.path),
                                         settings.steps, settings.batch, settings.lr, run.seed, log=log.info,
                                         progress=lambda done, total: progress_event(
                                             "stage_step", name="warmup", done=done, total=total),
                                         copy_steps=settings.copy_steps))
        save_hf(model, tmp / "ckpt", model.config, target="bf16", extra_files=tokenizer_files(checkpoint.path))

    run.store.publish_once(_rel(run), build, is_dir=True)
    return run.store.handle(_rel(run), "hf", version=0, inner="ckpt", **metrics)
