"""Claim: one-step-off-policy mode (``--max-staleness 1``) overlaps the next batch's rollout with the
train step and so shortens an iteration, at a reward cost (the batch is one version stale) that TIS
is meant to keep small; the KL penalty to the frozen reference (``--kl-coef``) costs one reference
forward per iteration and holds the policy nearer its start.

The real pipeline (``flows.pipeline.rl_run``, Prefect in embedded mode, every stage and artifact),
four configurations in one process, one after the other, same seed, same settings otherwise:
``sync`` (the baseline), ``off-policy`` (max_staleness 1), ``sync+kl`` and ``off-policy+kl``
(kl_coef ``--kl-coef``), ``stale-2`` and ``stale-4`` (max_staleness 2 and 4: the staleness of a
peer's asynchronous setting, at the overlap of one engine; ``--configs`` picks some). The supervised warm-up runs once (the ``prepare`` flow of a run of its own);
every configuration starts from its weights (``--source file://...``, no warm-up of its own), which
are also the KL reference (``--source URL``: start from that checkpoint instead). Per configuration: median wall seconds per iteration over iterations
1..N-1 (``seconds_iteration``: the iteration flow's body; iteration 0 of the off-policy mode also
samples the first batch in line and is the pipeline's fill), the seconds the train step ran, how
long the rollout sampled ahead ran and how long the flow then still waited for it, train reward at
each iteration, held-out reward after the last, and the k3 KL to the reference of the last update.
Ratios are against ``sync`` measured in the same run. The order of the configurations alternates
from seed to seed, so a machine whose load drifts during the run does not favour one of them; the
train step's own seconds (which overlap does not change) show how loaded the machine was during
each configuration.

    python benchmarks/off_policy.py [--preset tiny] [--iterations 10] [--seeds 0 1] [--kl-coef 0.1] [--lr 3e-3]
        [--task-runner dask --rollout-workers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

class LowercaseShare:
    """The benchmark's own dense environment (``--env benchmarks.off_policy:make_env``, the default):
    ``"say:abc="`` -> anything; reward: the share of the completion's characters that are a-z. It has
    no reference answers, so the pipeline skips the warm-up and the KL reference is the seeded init."""

    name = "lowercase-share"

    def prompts(self, rng, n):
        return ["say:" + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4))) + "=" for _ in range(n)]

    def reward(self, prompt, completion):
        return sum("a" <= c <= "z" for c in completion) / len(completion) if completion else 0.0


def make_env() -> LowercaseShare:
    return LowercaseShare()


CONFIGS = {
    "sync": dict(max_staleness=0, kl_coef=0.0),
    "off-policy": dict(max_staleness=1, kl_coef=0.0),
    "sync+kl": dict(max_staleness=0, kl_coef=None),
    "off-policy+kl": dict(max_staleness=1, kl_coef=None),
    "stale-2": dict(max_staleness=2, kl_coef=0.0),
    "stale-4": dict(max_staleness=4, kl_coef=0.0),
}


def warmed_up(root: str, preset: str, seed: int, a) -> str:
    """The URL of the warmed-up policy every configuration of ``seed`` starts from."""
    from flows.pipeline import RLSettings, prepare

    settings = RLSettings.from_dict(dict(preset=preset, seed=seed, artifacts=root, run_id=f"warmup-s{seed}", env=a.env,
                                         warmup_steps=a.warmup_steps))
    return Path(prepare(settings).policy.path).as_uri()


def run(root: str, preset: str, seed: int, iterations: int, name: str, grpo: dict, source: str, a) -> dict:
    from flows.pipeline import RLSettings, rl_run

    settings = RLSettings.from_dict(dict(
        preset=preset, source=source, warmup_steps=0, iterations=iterations, seed=seed, artifacts=root,
        run_id=f"{name.replace('+', '-')}-s{seed}", env=a.env, eval_prompts=a.eval_prompts, eval_every=0, lr=a.lr,
        **({"task_runner": a.task_runner, "rollout_workers": a.rollout_workers} if a.task_runner != "local" else {}),
        **{k: (a.kl_coef if v is None else v) for k, v in grpo.items()}))
    summary = rl_run(settings)
    metrics = json.loads(Path(root, "runs", settings.pipeline.run_id, "metrics.json").read_text())
    steady = metrics[1:] or metrics

    def med(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steady)

    return dict(seconds_per_iteration=med("seconds_iteration"), seconds_train=med("seconds_train"),
                seconds_rollout=med("seconds_rollout"), seconds_rollout_ahead=med("seconds_rollout_ahead"),
                seconds_rollout_wait=med("seconds_rollout_wait"), seconds_reference=med("seconds_reference"),
                train_reward=[m["reward_mean"] for m in metrics], heldout_end=summary["heldout_reward_end"],
                staleness=[m["staleness"] for m in metrics], kl_ref_last=metrics[-1].get("kl_ref_last", 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--kl-coef", type=float, default=0.1)
    ap.add_argument("--env", default="benchmarks.off_policy:make_env")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=25, help="with an environment that has reference answers")
    ap.add_argument("--source", default="", help="start every configuration from this checkpoint URL instead of "
                    "warming up (e.g. a warm-up of an earlier run of this script)")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--task-runner", default="local", choices=("local", "dask", "ray"),
                    help="dask|ray: rollout shards on --rollout-workers resident engines (the batch sampled ahead "
                         "runs there, beside the train step in this process)")
    ap.add_argument("--rollout-workers", type=int, default=2)
    ap.add_argument("--json", default=None, help="write every configuration's figures here")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    names = a.configs.split(",")
    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="k3rl-offpolicy-") as root:
        for i, seed in enumerate(a.seeds):
            source = a.source or warmed_up(root, a.preset, seed, a)
            for name in (names if i % 2 == 0 else names[::-1]):  # alternate the order: load drift cancels
                r = run(root, a.preset, seed, a.iterations, name, CONFIGS[name], source, a)
                results[(name, seed)] = r
                print(f"{name:<14} seed {seed}: {r['seconds_per_iteration']:.2f} s/iter (train "
                      f"{r['seconds_train']:.2f}, rollout in line {r['seconds_rollout']:.2f}, ahead "
                      f"{r['seconds_rollout_ahead']:.2f}, waited {r['seconds_rollout_wait']:.2f}, reference "
                      f"{r['seconds_reference']:.2f}); train reward "
                      f"{' '.join(f'{x:.3f}' for x in r['train_reward'])}; held-out end {r['heldout_end']:.3f}; "
                      f"staleness {r['staleness']}; kl_ref last {r['kl_ref_last']:.4f}", flush=True)
    n = a.iterations
    print(f"\npreset {a.preset}, env {a.env}, {n} iterations, seeds {a.seeds}, kl_coef {a.kl_coef}, "
          f"{a.threads} torch thread(s), task runner {a.task_runner}"
          f"{f' ({a.rollout_workers} rollout workers)' if a.task_runner != 'local' else ''}; medians over seeds")
    print("| config | s / iteration | vs sync | train s | rollout ahead s | waited s | reference s | "
          "train reward, last 3 iterations | held-out end | kl_ref (last update) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for name in names:
        rs = [results[(name, s)] for s in a.seeds]

        def med(key: str, rs=rs) -> float:
            return statistics.median(r[key] for r in rs)

        sec = med("seconds_per_iteration")
        base = sec if base is None else base
        last3 = statistics.median(statistics.mean(r["train_reward"][-3:]) for r in rs)
        print(f"| {name} | {sec:.2f} | {sec / base:.2f}x | {med('seconds_train'):.2f} | "
              f"{med('seconds_rollout_ahead'):.2f} | {med('seconds_rollout_wait'):.2f} | {med('seconds_reference'):.2f} | "
              f"{last3:.3f} | {med('heldout_end'):.3f} | {med('kl_ref_last'):.4f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({f"{k[0]}:{k[1]}": v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
