"""How long a ``k3rl run`` will take, said before it starts (its first lines of output).

Owns: a cost model of a run on the CPU presets, per stage, calibrated on the developers' 2-core
machine by ``benchmarks/rl_defaults.py`` (the measured stage seconds of `make run`, in
docs/results/make_run.md). Each stage's cost scales with the work the settings give it: rollout
and train with the samples and tokens of an iteration, the evaluation with its prompts, the warm-up
with its sequences. Does not own: the measured pace once iterations finish (``k3rl run``'s
iteration lines say the time left at that pace).

An estimate, not a promise: a machine under load, or with other cores, takes longer or shorter,
and the GPU presets have no calibration here (``estimate`` returns None for them).
"""

from __future__ import annotations

import dataclasses
import os

from k3core.settings import COPY_BATCH_FACTOR, RLSettings

__all__ = ["estimate", "estimate_line"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Seconds of one unit of each stage's work on the calibration machine (2 torch threads)."""

    start: float            # Prefect's embedded server, imports, fetch, validate, quantize
    warmup_sequence: float  # one sequence of one supervised warm-up step
    rollout_token: float    # one sampled completion token (rollout), prefill included
    train_sample: float     # one sequence through one PPO epoch (forward + backward, logp_old)
    score_sample: float
    iteration: float        # save, transfer, records and Prefect's per-iteration work
    mismatch_sequence: float
    eval_prompt: float      # one held-out prompt, sampled and greedy, scored


# From `make run`'s stage seconds at the default settings, on 2 idle cores (docs/results/make_run.md).
CALIBRATIONS = {
    "small": Calibration(start=20.0, warmup_sequence=0.0286, rollout_token=0.00153, train_sample=0.0285,
                         score_sample=0.0009, iteration=3.4, mismatch_sequence=0.084, eval_prompt=0.033),
}


def estimate(s: RLSettings, cores: int | None = None) -> float | None:
    """Seconds the run will take from its start, or None where nothing is calibrated (a GPU, a preset
    without a calibration, a rollout server or a scale-out runner doing the work elsewhere)."""
    from k3core.device import run_device

    cal = CALIBRATIONS.get(s.model.preset)
    if (cal is None or run_device(s).type != "cpu" or s.rollout.url != "local" or s.scale_out.task_runner != "local"
            or s.scale_out.train_procs > 1):
        return None
    cores = cores or os.cpu_count() or 2
    samples = s.rollout.prompts_per_iteration * s.rollout.samples_per_prompt
    refills = 1 + s.grpo.refill_rounds / 2  # a refill round samples again for the uniform groups only (about half)
    per_iteration = (cal.iteration + refills * samples * (cal.rollout_token * s.rollout.max_new_tokens + cal.score_sample)
                     + samples * cal.train_sample * s.grpo.ppo_epochs
                     + (cal.mismatch_sequence * s.evaluation.mismatch_sequences / s.evaluation.mismatch_every
                        if s.evaluation.mismatch_every else 0.0))
    n = s.pipeline.iterations
    evals = 1 + (len(range(0, n, s.evaluation.every)) if s.evaluation.every else 0)
    warm = (s.warmup.steps + COPY_BATCH_FACTOR * s.warmup.copy_steps) * s.warmup.batch  # a copy sequence costs about a demo's
    total = (cal.start + warm * cal.warmup_sequence + n * per_iteration
             + evals * s.evaluation.prompts * cal.eval_prompt)
    return total * 2 / min(max(cores, 1), 2)  # calibrated on 2 cores; more cores than 2 are not counted on


def estimate_line(s: RLSettings) -> str:
    """The sentence ``k3rl run`` prints first: the estimate and what it assumes."""
    seconds = estimate(s)
    if seconds is None:
        return ("no time estimate for this preset and device; each iteration's line says the time left at the "
                "pace so far")
    shown = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
    return (f"expect about {shown} on {os.cpu_count()} idle cores (estimated from the settings; a loaded machine "
            "takes longer; each iteration's line says the time left at the pace so far)")
