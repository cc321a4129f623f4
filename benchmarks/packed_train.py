"""Claim: a GRPO step on a batch of mixed lengths trains more tokens per second packed (sequences back
to back, ``cu_seqlens``) than right-padded, and wastes no position on padding.

One batch of ``--sequences`` rollouts whose prompt and completion lengths are drawn (seeded) from
ranges like an RL batch's (short prompts, completions from a few tokens to ``--max-new``), with
routing replay (the rollout's experts forced, as in the pipeline). The same ``grpo_train_step``
(1 epoch x 1 minibatch, plain SGD so the optimizer costs nothing) runs in both layouts under the same
``--micro-batch-tokens`` budget (padded: sequences x longest input; packed: real tokens), the two
alternating ``--repeats`` times in one process after one warm-up step each, so load on a shared
machine hits both alike. Printed: real tokens per second of each (the median over repeats), their
ratio, micro-batches, and the padding: the share of positions the model computes that are padding
(embedding, projections, MoE, head). Packed has none at that level; its CPU attention kernels still
pad inside (the torch KDA varlen path and MLA scatter each micro-batch to ``[N, T_max]``, reported as
``attention padding``); fla's varlen kernel on CUDA does not.

    python benchmarks/packed_train.py [--preset small] [--sequences 32] [--micro-batch-tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def make_batch(cfg, n: int, seed: int, prompt: tuple[int, int], new: tuple[int, int]):
    from k3core.rl.train import RLSequence

    g = torch.Generator().manual_seed(seed)
    n_moe, k, E = len(cfg.moe_layers), cfg.num_experts_per_token, cfg.num_experts
    seqs = []
    for _ in range(n):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        o = int(torch.randint(new[0], new[1] + 1, (1,), generator=g))
        ids = torch.randint(0, 256, (p + o,), generator=g).tolist()
        routing = torch.rand(p + o - 1, n_moe, E, generator=g).argsort(-1)[..., :k].to(torch.int16)
        seqs.append(RLSequence(ids[:p], ids[p:], (-3.0 - torch.rand(o, generator=g)).tolist(),
                               float(torch.randn(1, generator=g)), routing))
    return seqs


def padding(seqs, budget: int, packed: bool) -> tuple[int, int, int]:
    """(real positions, positions the model computes, positions the attention kernels compute on
    the CPU) over the micro-batches of one step."""
    from k3core.rl.train import micro_batches

    lengths = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs]
    real = sum(lengths)
    model = attn = 0
    for mb in micro_batches(lengths, budget, packed):
        longest = max(lengths[i] for i in mb)
        model += sum(lengths[i] for i in mb) if packed else len(mb) * longest
        attn += len(mb) * longest
    return real, model, attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt", type=int, nargs=2, default=(8, 48), help="prompt length range")
    ap.add_argument("--max-new", type=int, default=192, help="completion lengths are drawn from [4, max-new]")
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.train import grpo_train_step
    from k3core.settings import GRPOSettings

    cfg = K3Config.preset(a.preset)
    torch.manual_seed(a.seed)
    model = K3ForCausalLM(cfg)
    model.reset_parameters(a.seed)
    seqs = make_batch(cfg, a.sequences, a.seed, tuple(a.prompt), (4, a.max_new))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put: every step does the same work
    layouts = {"padded": False, "packed": True}
    settings = {name: GRPOSettings(routing_replay=True, packing=packed, micro_batch_tokens=a.micro_batch_tokens)
                for name, packed in layouts.items()}
    real = sum(len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs)
    print(f"{a.preset}: {a.sequences} sequences, {real} input positions (lengths "
          f"{min(len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs)}-"
          f"{max(len(s.prompt_ids) + len(s.output_ids) - 1 for s in seqs)}), budget {a.micro_batch_tokens} tokens, "
          f"{a.threads} thread(s)", flush=True)
    rates: dict[str, list[float]] = {n: [] for n in layouts}
    micro = {}
    for name in layouts:  # warm-up
        grpo_train_step(model, opt, seqs, settings[name], cfg.pad_token_id)
    for _ in range(a.repeats):
        for name in layouts:
            t0 = time.perf_counter()
            m = grpo_train_step(model, opt, seqs, settings[name], cfg.pad_token_id)
            rates[name].append(real / (time.perf_counter() - t0))
            micro[name] = m["micro_batches"]
    for name, packed in layouts.items():
        r, computed, attn = padding(seqs, a.micro_batch_tokens, packed)
        print(f"{name:>6}: {statistics.median(rates[name]):8.1f} tokens/s (median of "
              f"{', '.join(f'{x:.1f}' for x in rates[name])}), {micro[name]} micro-batches, padding "
              f"{1 - r / computed:.1%} of {computed} positions computed, attention padding {1 - r / attn:.1%}",
              flush=True)
    ratio = statistics.median(rates["packed"]) / statistics.median(rates["padded"])
    print(f"packed / padded tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
