"""Claim: running agent episodes on a thread each (``run_episodes(schedule="continuous")``, the
default) finishes a rollout whose tools take unequal times sooner than running them in rounds
(``schedule="rounds"``: every live episode waits for the slowest tool of the round before any
samples its next turn), because an episode's next turn joins the engine's running batch as soon as
its own tools return.

Same run, same weights, same seeds: ``--episodes`` episodes of ``--turns`` turns on a ``--preset``
engine (random init, float32, kept decode state). Each turn the model samples until any id of a stop
set (1/``--stop-every`` of the vocabulary, so turns vary in length around that many tokens); the turn
then goes on with a scripted calculator call, so every episode calls a tool each turn, and answers on
its last. The tool sleeps a latency drawn per (episode, turn) from a long tail: ``--slow-fraction``
of the calls take ``--slow-seconds``, the rest ``--fast-seconds`` (a test run or a fetch that
sometimes stalls). Reported per schedule: wall seconds, sampled tokens, tokens/s, the sum of tool
seconds, and the ratio rounds / continuous. Both schedules sample the same ids where no rounding
flips a sample (the count of episodes whose ids differ is printed).

    python benchmarks/episode_schedule.py [--preset small] [--episodes 32] [--turns 8]
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from dataclasses import replace

import torch

from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.envs import load_env
from k3core.rl.episodes import run_episodes
from k3core.rl.prompting import PromptFormat
from k3core.rollout.engine import RolloutEngine, SamplingParams
from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer
from k3core.tokenizer.tool_calls import format_tool_calls


class SampledThenCall:
    """Each turn: the engine's sampled ids up to a stop id, then a scripted call of turn k (the
    answer ``1`` on the last turn) and the end-of-turn id."""

    def __init__(self, engine: RolloutEngine, tok, stops: list[int], turns: int):
        self.engine, self.tok, self.stops, self.turns = engine, tok, stops, turns
        self.sampled, self._lock = 0, threading.Lock()  # ids the engine sampled (the scripted tails not counted)

    def generate(self, prompts, params, sessions=None):
        real = self.engine.generate(prompts, replace(params, stop_token_ids=self.stops), sessions=sessions)
        out = []
        for p, c in zip(prompts, real):
            with self._lock:
                self.sampled += len(c.output_ids)
            k = p.count(self.tok.special_ids["<|im_assistant|>"]) - 1
            call = {"function": {"name": "calculator", "arguments": {"expression": f"{k}*1"}}}
            tail = self.tok.encode(format_tool_calls([call]) if k < self.turns - 1 else "1")
            tail += [self.tok.special_ids["<|im_end|>"]]
            out.append(replace(c, output_ids=c.output_ids + tail, logprobs=c.logprobs + [0.0] * len(tail),
                               finish_reason="stop"))
        return out

    def release_sessions(self, sessions):
        return self.engine.release_sessions(sessions)

    def driving(self):
        return self.engine.driving()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--stop-every", type=int, default=16, help="1 id in this many ends a turn")
    ap.add_argument("--slow-fraction", type=float, default=0.1)
    ap.add_argument("--slow-seconds", type=float, default=1.0)
    ap.add_argument("--fast-seconds", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per schedule; the best is reported")
    args = ap.parse_args()
    tok = load_tokenizer(BUNDLED_K3_BPE)
    cfg = K3Config.preset(args.preset).replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                               eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    model.reset_parameters(0)
    engine = RolloutEngine(model.eval(), max_batch=args.episodes)
    env = load_env("tools-calc")
    env.max_turns = args.turns  # the benchmark's turns, not the environment's own cap of 3
    fmt = PromptFormat.of(tok, env)
    stops = list(range(0, tok.vocab_size, args.stop_every))
    policy = SampledThenCall(engine, tok, stops, args.turns)
    prompts = [f"Compute {100 + i}*{200 + i}." for i in range(args.episodes)]
    params = SamplingParams(max_new_tokens=4 * args.stop_every, temperature=1.0, seed=7)

    def tool(prompt, name, arguments):
        draw = random.Random(f"{prompt}|{arguments.get('expression')}").random()
        time.sleep(args.slow_seconds if draw < args.slow_fraction else args.fast_seconds)
        return "0"

    def rollout(schedule):
        policy.sampled = 0
        t0 = time.perf_counter()
        eps = run_episodes(policy, fmt, env, prompts, params, max_turns=args.turns, max_tokens=1 << 20,
                           tool_runner=tool, tool_workers=args.episodes, schedule=schedule)
        return time.perf_counter() - t0, eps, policy.sampled

    rollout("continuous")  # first calls (allocator, kernels) out of the timing
    best: dict[str, tuple[float, list, int]] = {}
    for _ in range(args.repeats):
        for schedule in ("rounds", "continuous"):
            run = rollout(schedule)
            if schedule not in best or run[0] < best[schedule][0]:
                best[schedule] = run
    print(f"preset {args.preset} (float32, {torch.get_num_threads()} threads), {args.episodes} episodes x "
          f"{args.turns} turns, turns end at 1 id in {args.stop_every}; tools: {args.slow_fraction:.0%} of calls "
          f"{args.slow_seconds} s, the rest {args.fast_seconds} s; best of {args.repeats}")
    print(f"{'schedule':>10} {'seconds':>8} {'sampled tokens':>15} {'tokens/s':>9} {'tool calls (slow)':>18} "
          f"{'tool seconds (sum)':>19}")
    for schedule, (secs, eps, sampled) in best.items():
        calls = [t["seconds"] for e in eps for t in e.turns if t["role"] == "tool"]
        slow = sum(c >= args.slow_seconds for c in calls)
        print(f"{schedule:>10} {secs:>8.2f} {sampled:>15} {sampled / secs:>9.1f} {len(calls):>11} ({slow:>4}) "
              f"{sum(calls):>19.1f}")
    differ = sum(a.ids != b.ids for a, b in zip(best["rounds"][1], best["continuous"][1]))
    print(f"rounds / continuous: {best['rounds'][0] / best['continuous'][0]:.2f}x the wall time; "
          f"episodes whose ids differ between the schedules: {differ} of {args.episodes}")


if __name__ == "__main__":
    main()
