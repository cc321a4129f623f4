"""Claim to measure (issue 37, item 2): what ``--in-flight continue`` does to the behaviour policy.
A sequence the weight update reaches mid-generation goes on with the new weights B on the decode
state (KDA recurrent states, conv tails, MLA latents) that the old weights A computed over its
prompt and first tokens, so its later tokens are sampled neither by A nor by B. How far from B?

Same run, same weights: A is ``make run``'s starting policy (``small`` after the 25-step supervised
warm-up on ``reverse``); a fp32 engine at A samples ``--sequences`` completions of ``--tokens`` tokens
(no stop id, so every sequence is still running at the update) on held-out ``reverse`` prompts;
after ``--swap-after`` decode steps it takes B with ``in_flight="continue"``. B is A after one step
of size ``--lr`` along the sign of a real policy-gradient (REINFORCE with random +-1 rewards on A's
own samples): the move of a fresh Adam's first step, which is what one RL update at that learning
rate makes. For every token sampled after the update, against uncached full forwards of A and B over
the same ids:

- ``KL(A||B)``: how far the policy moved (the mismatch a drained batch's stale tokens carry to B);
- ``KL(behaviour||B)``: what continuing leaves, the behaviour rows being the engine's own logits
  (B on A's state); ``abort`` (sampling again under B) would leave 0 up to rounding;
- their ratio, and the same KL for the first and the last eight of those tokens (the old state's
  share of the context shrinks as the sequence goes on).

    python benchmarks/in_flight_mismatch.py [--preset small] [--lr 2e-4,1e-3] [--swap-after 4,16]
"""

from __future__ import annotations

import argparse
import copy

import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rollout.engine import RolloutEngine, SamplingParams


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p||q) per row, from logits [N, V]."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def _sign_step(model: K3ForCausalLM, prompts, tokens: int, lr: float, seed: int) -> K3ForCausalLM:
    """``model`` after one step of ``lr`` along -sign(grad) of a REINFORCE loss on its own samples."""
    eng = RolloutEngine(copy.deepcopy(model), max_batch=len(prompts))
    comps = eng.generate(prompts, SamplingParams(max_new_tokens=tokens, seed=seed))
    g = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model).train()
    loss = 0.0
    for c in comps:
        ids = torch.tensor([c.prompt_ids + c.output_ids])
        logits = new(ids).logits[0, len(c.prompt_ids) - 1:-1]
        lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c.output_ids)[:, None]).sum()
        loss = loss - (1.0 if torch.rand((), generator=g) < 0.5 else -1.0) * lp
    loss.backward()
    with torch.no_grad():
        for p in new.parameters():
            if p.grad is not None:
                p.sub_(lr * p.grad.sign())
                p.grad = None
    return new.eval()


def measure(base: K3ForCausalLM, prompts, tokens: int, lr: float, swap_after: int, seed: int) -> dict:
    a, b = copy.deepcopy(base), _sign_step(base, prompts, tokens, lr, seed)
    eng = RolloutEngine(copy.deepcopy(a), max_batch=len(prompts), record_logits=True)
    futures = eng.submit_many([(p, SamplingParams(max_new_tokens=tokens, seed=seed + 1 + i), None)
                               for i, p in enumerate(prompts)])
    for _ in range(swap_after):
        eng.step()
    eng.load_weights(b.state_dict(), 1, in_flight="continue")
    while eng.step():
        pass
    kl_ab, kl_cb, first, last = [], [], [], []
    with torch.no_grad():
        for f in futures:
            (c,) = f.result()
            new = torch.tensor([v == 1 for v in c.token_versions])
            if not new.any():
                continue
            ids = torch.tensor([c.prompt_ids + c.output_ids[:-1]])
            rows = slice(len(c.prompt_ids) - 1, None)
            la, lb = a(ids).logits[0, rows][new], b(ids).logits[0, rows][new]
            behaviour = c.meta["logits"][new]
            kl_ab.append(_kl(la, lb))
            kl = _kl(behaviour, lb)
            kl_cb.append(kl)
            first.append(kl[:8])
            last.append(kl[-8:])
    ab, cb = torch.cat(kl_ab).mean().item(), torch.cat(kl_cb).mean().item()
    return {"tokens_after": int(torch.cat(kl_cb).numel()), "kl_ab": ab, "kl_cb": cb, "ratio": cb / ab,
            "kl_cb_first8": torch.cat(first).mean().item(), "kl_cb_last8": torch.cat(last).mean().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=25)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--lr", default="2e-4,1e-3")
    p.add_argument("--swap-after", default="4,16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from k3core.rl.data import heldout_prompts
    from k3core.rl.envs import load_env
    from k3core.rl.warmup import warmed_up_model
    from k3core.tokenizer import ByteTokenizer

    config = K3Config.preset(a.preset)
    base = warmed_up_model(config, steps=a.warmup_steps, seed=a.seed).eval()  # make run's start: reverse, 25 steps
    tok = ByteTokenizer(config)
    prompts = [tok.encode(x) for x in heldout_prompts(load_env("reverse"), a.seed, a.sequences, "reverse")]
    print(f"{a.preset} after {a.warmup_steps} warm-up steps on reverse, fp32, {a.sequences} held-out reverse prompts, "
          f"{a.tokens} sampled tokens each (no stop); B = A after one sign step of size lr (torch {torch.__version__})")
    print()
    print("| lr | swap after | tokens after it | KL(A\\|\\|B) | KL(behaviour\\|\\|B) | ratio | first 8 | last 8 |")
    print("|---|---|---|---|---|---|---|---|")
    for lr in (float(x) for x in a.lr.split(",")):
        for k in (int(x) for x in a.swap_after.split(",")):
            m = measure(base, prompts, a.tokens, lr, k, a.seed)
            print(f"| {lr:g} | {k} | {m['tokens_after']} | {m['kl_ab']:.3e} | {m['kl_cb']:.3e} | {m['ratio']:.3f} | "
                  f"{m['kl_cb_first8']:.3e} | {m['kl_cb_last8']:.3e} |", flush=True)


if __name__ == "__main__":
    main()
