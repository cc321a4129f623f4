"""Claim: keeping each episode's decode state between turns (``RolloutEngine`` sessions: KDA states,
conv tails and MLA latents kept after a turn, the next turn prefilling only the ids it adds) makes
multi-turn rollout faster than re-prefilling the whole history every turn, by more the more turns an
episode has; and it costs a fixed amount of memory per live episode (KDA) plus one latent per token
(MLA).

Same run, same weights: ``--episodes`` episodes at once, each ``T`` turns (``--turns``) of
``--turn-tokens`` sampled ids (a turn ends by a stop checker after that many, as an end-of-turn id
would end it) followed by ``--tool-tokens`` appended ids (a tool result), from a ``--prompt-tokens``
prompt. Both engines sample the same ids (the tokens are checked equal, which also checks that the two
paths agree). Reported per T: wall seconds and prefill tokens of each path, the ratio, and the kept
state's bytes per episode at the end.

    python benchmarks/episode_state.py [--preset small] [--turns 2,8,32] [--episodes 8]
"""

from __future__ import annotations

import argparse
import time

import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rollout.engine import RolloutEngine, SamplingParams


def _episodes(eng: RolloutEngine, prompts, turns: int, turn_tokens: int, tool_tokens: int, seed: int, keep: bool):
    """Run the episodes turn by turn on ``eng``; -> (seconds, the ids of every episode, kept bytes at the end)."""
    g = torch.Generator().manual_seed(seed)
    tools = [[torch.randint(0, eng.config.vocab_size, (tool_tokens,), generator=g).tolist() for _ in prompts]
             for _ in range(turns)]
    stop = lambda ids: "turn" if len(ids) >= turn_tokens else None  # noqa: E731
    ids = [list(p) for p in prompts]
    sessions = [f"e{i}" for i in range(len(prompts))] if keep else None
    kept = 0
    t0 = time.perf_counter()
    for t in range(turns):
        futures = eng.submit_many([(x, SamplingParams(max_new_tokens=turn_tokens + 1, seed=seed + 97 * t + i), stop)
                                   for i, x in enumerate(ids)], bounded=False, sessions=sessions)
        while eng.step():
            pass
        for i, f in enumerate(futures):
            ids[i] = ids[i] + f.result()[0].output_ids + (tools[t][i] if t < turns - 1 else [])
    secs = time.perf_counter() - t0
    if keep:
        kept = eng.kept_sessions()["bytes"] / len(prompts)
        held = _allocated(eng)
        eng.release_sessions(sessions)
        freed = (held - _allocated(eng)) / len(prompts)
    return secs, ids, kept, (freed if keep else 0)


def _allocated(eng: RolloutEngine) -> int:
    """Bytes the engine's device allocator holds on CUDA (0 on the CPU: not measured there): what
    releasing the sessions gives back, beside the sessions' own count of their tensors."""
    dev = next(eng.model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return torch.cuda.memory_allocated(dev)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--turns", default="2,8,32")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--tool-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda: also the device memory the sessions free)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = K3Config.preset(args.preset)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    model.reset_parameters(0)
    model = model.cast(getattr(torch, args.dtype)).to(args.device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.episodes)]
    eng = RolloutEngine(model, max_batch=args.episodes, decode="dynamic")
    print(f"preset {args.preset} ({args.dtype} on {args.device}, {torch.get_num_threads()} threads), {args.episodes} episodes at once, "
          f"prompt {args.prompt_tokens} tokens, turns of {args.turn_tokens} sampled + {args.tool_tokens} tool tokens")
    print(f"{'turns':>5} {'history':>8} {'re-prefill s':>13} {'kept s':>8} {'speedup':>8} {'prefill tokens (re / kept)':>27} "
          f"{'kept MiB/episode':>17} {'freed device MiB/episode':>25}")
    _episodes(eng, prompts[:2], 2, 4, 4, seed=0, keep=True)  # first calls (allocator, kernels) out of the timing
    for turns in (int(x) for x in args.turns.split(",")):
        rows = {}
        for keep in (False, True):
            eng.session_bytes = 64 << 30 if keep else 0
            before = eng.stats["prefill_tokens"]
            secs, ids, kept, freed = _episodes(eng, prompts, turns, args.turn_tokens, args.tool_tokens, seed=turns,
                                               keep=keep)
            rows[keep] = (secs, eng.stats["prefill_tokens"] - before, ids, kept, freed)
        same = rows[False][2] == rows[True][2]
        print(f"{turns:>5} {len(rows[True][2][0]):>8} {rows[False][0]:>13.2f} {rows[True][0]:>8.2f} "
              f"{rows[False][0] / rows[True][0]:>7.2f}x {rows[False][1]:>13} / {rows[True][1]:<11} "
              f"{rows[True][3] / 2**20:>17.2f} {rows[True][4] / 2**20:>25.2f}" + ("" if same else "   (sampled ids differ: rounding flipped a sample)"))


if __name__ == "__main__":
    main()
