"""quantize_mxfp4: routed-expert weights to MXFP4 in the release layout (the rollout engine's
weights, version 0); everything else stays bf16/fp32 as the release declares."""

from __future__ import annotations

from k3core.artifacts import Artifact
from tasks.common import Run, stage


def _rel(run: Run) -> str:
    return run.rel("rollout-weights-v0")


@stage(run_name="quantize_mxfp4", key="quantize", outputs=lambda run, **_: [run.uri(_rel(run))],
       inputs=lambda policy, **_: [policy.uri])
def quantize_mxfp4(run: Run, policy: Artifact) -> Artifact:
    """The policy loaded on the run's device and its routed experts quantised there (``k3core.ops.mxfp4``:
    the Triton kernel on CUDA, the torch codec on the CPU; both give the same bytes)."""
    from k3core.checkpoint.hf import save_hf, tokenizer_files
    from k3core.rl.weights import load_policy

    def build(tmp):
        model = load_policy(policy.path, device=run.device)
        save_hf(model, tmp / "ckpt", model.config, target="mxfp4", extra_files=tokenizer_files(policy.path))

    run.store.publish_once(_rel(run), build, is_dir=True)
    return run.store.handle(_rel(run), "hf-mxfp4", version=policy.version, inner="ckpt")
