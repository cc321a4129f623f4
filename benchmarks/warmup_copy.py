"""Claim: the warm-up's copy phase (``--warmup-copy-steps``, ``k3core.rl.warmup``) lets a fresh model
learn an agentic environment's reference episodes in fewer steps than the reference-only warm-up.

Each configuration warms up a fresh model of ``--preset`` (same seed, same prompts) with
``k3core.rl.warmup.supervised_warmup``, the function the warmup stage runs, and every
``--eval-every`` steps measures the held-out greedy exact rate: the share of 64 held-out reference
episodes whose every trained token is the model's argmax under teacher forcing. That is the share
greedy decoding reproduces whole: the tools' answers depend only on the calls, so by induction a
model right at every trained position writes the same calls, gets the same results and gives the
same answer (a lower bound of greedy's reward-1 rate). Printed per evaluation: configuration, step,
phase, wall seconds since the start (its evaluations included: one forward each), the exact rate,
and the same rate on the held-out prompts' copy sequences (what the copy phase teaches).

    python benchmarks/warmup_copy.py --env tools-calc --configs copy,reference --copy-steps 100 --steps 150
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--env", default="tools-calc")
    ap.add_argument("--configs", default="copy,reference", help="copy: --copy-steps then --steps; reference: "
                    "--copy-steps + --steps reference steps (the same number of optimizer steps)")
    ap.add_argument("--copy-steps", type=int, default=100)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from k3core.checkpoint.hf import _with_tokenizer
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.data import heldout_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.episodes import reference_trajectory
    from k3core.rl.prompting import PromptFormat
    from k3core.rl.train import RLSequence, pack_sequences
    from k3core.rl.warmup import copy_sequence, copy_text, supervised_warmup
    from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer

    cfg = _with_tokenizer(K3Config.preset(a.preset), "bpe")[0]
    env = load_env(a.env)
    fmt = PromptFormat.of(load_tokenizer(BUNDLED_K3_BPE), env)
    held, copies = [], []
    for p in heldout_prompts(env, a.seed, 64, a.env):
        ep = reference_trajectory(fmt, env, p)
        held.append(RLSequence(ep.prompt_ids, ep.output_ids, loss_mask=ep.loss_mask))
        copies.append(copy_sequence(fmt, copy_text(env, p)))
    episodes, copies = pack_sequences(held, fmt.pad_id), pack_sequences(copies, fmt.pad_id)

    @torch.no_grad()
    def exact(model, batch) -> float:
        model.eval()
        pred = model(batch["input_ids"], batch["valid"], return_logits=True).logits.argmax(-1)
        model.train()
        ok = (pred == batch["targets"]) | ~batch["gen_mask"].bool()
        return float(ok.all(-1).float().mean())

    print(f"preset {a.preset}, env {a.env}, batch {a.batch}, lr {a.lr}, {torch.get_num_threads()} threads; "
          f"held-out greedy exact of 64 reference episodes")
    print(f"{'config':>10}{'step':>6}{'phase':>11}{'seconds':>9}{'exact':>7}{'copy exact':>11}")
    for name in a.configs.split(","):
        copy_steps, steps = (a.copy_steps, a.steps) if name == "copy" else (0, a.copy_steps + a.steps)
        torch.manual_seed(a.seed)
        model = K3ForCausalLM(cfg)
        model.reset_parameters(a.seed)
        t0 = time.perf_counter()

        def progress(done: int, total: int, model=model, copy_steps=copy_steps, name=name, t0=t0) -> None:
            if done % a.eval_every == 0 or done == total:
                phase = "copy" if done <= copy_steps else "reference"
                print(f"{name:>10}{done:>6}{phase:>11}{time.perf_counter() - t0:9.0f}"
                      f"{exact(model, episodes):7.3f}{exact(model, copies):11.3f}", flush=True)

        supervised_warmup(model, env, a.env, fmt, steps, a.batch, a.lr, a.seed, progress=progress,
                          copy_steps=copy_steps)


if __name__ == "__main__":
    main()
