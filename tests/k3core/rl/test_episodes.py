"""Multi-turn episodes (``k3core.rl.episodes``) on the bundled BPE's chat template, driven by a
scripted policy whose turns are known: the trajectory's ids equal the template's rendering of the
whole conversation (token-in/token-out: appended, never re-rendered), the loss mask is 1 exactly on
the sampled turns, tools that fail become ``error:`` results, a malformed section a user turn, and
the limits end episodes. Then the real tiny engine: rows of ``rollout_table`` for ``tools-calc``
carry the mask into the train step's sequences, and routing covers every position."""

import json
import threading
from dataclasses import replace

import pytest
import torch

from k3core.rl.envs import load_env
from k3core.rl.episodes import EpisodeLimits, final_answer, reference_trajectory, run_episodes
from k3core.rl.prompting import PromptFormat
from k3core.rollout.engine import Completion, SamplingParams
from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer
from k3core.tokenizer.tool_calls import format_tool_calls

PROMPT = "Compute 123*456."
CALL = {"id": "functions.calculator:0", "type": "function",
        "function": {"name": "calculator", "arguments": "{\"expression\": \"123*456\"}"}}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUNDLED_K3_BPE)


class Scripted:
    """A client that answers an episode's k-th assistant turn with ``turns[k]`` (then the end-of-turn id)."""

    def __init__(self, tok, turns, stop=True):
        self.tok, self.turns, self.calls, self.stop = tok, turns, [], stop

    def generate(self, prompts, params, **_):
        self.calls.append([list(p) for p in prompts])
        end = self.tok.special_ids["<|im_end|>"]
        out = []
        for i, p in enumerate(prompts):
            k = p.count(self.tok.special_ids["<|im_assistant|>"]) - 1  # assistant turns before this one
            ids = (self.tok.encode(self.turns[min(k, len(self.turns) - 1)]) + ([end] if self.stop else []))
            ids = ids[:params.max_new_tokens]
            reason = "stop" if ids and ids[-1] == end else "length"
            out.append(Completion(i, 0, list(p), ids, [-0.25] * len(ids), None, reason, 4, {"matched": end}))
        return out


def _params(n=1, max_new=64):
    return SamplingParams(max_new_tokens=max_new, temperature=1.0, n=n, seed=3)


def test_trajectory_ids_are_the_conversation_rendered_and_only_turns_are_trained(tok):
    env = load_env("tools-calc")
    fmt = PromptFormat.of(tok, env)
    client = Scripted(tok, [format_tool_calls([CALL]), "56088"])
    (ep,) = run_episodes(client, fmt, env, [PROMPT], _params())
    convo = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": PROMPT},
             {"role": "assistant", "content": "", "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": CALL["id"], "content": "56088"},
             {"role": "assistant", "content": "56088"}]
    assert ep.ids == tok.apply_chat_template(convo, tools=env.tools, add_generation_prompt=False)
    assert ep.finish_reason == "answer" and final_answer(tok.decode(ep.output_ids)) == "56088"
    # the second call's prompt is the whole trajectory so far (re-prefill), ending with the generation prompt
    assert client.calls[1][0] == ep.ids[:len(ep.ids) - len(tok.encode("56088")) - 1]
    a1 = len(tok.encode(format_tool_calls([CALL]))) + 1
    a2 = len(tok.encode("56088")) + 1
    env_part = len(ep.output_ids) - a1 - a2
    assert ep.loss_mask == [1] * a1 + [0] * env_part + [1] * a2
    assert ep.logprobs == [-0.25] * a1 + [0.0] * env_part + [-0.25] * a2
    tool_turn = next(t for t in ep.turns if t["role"] == "tool")
    assert tool_turn["result"] == "56088" and tool_turn["span"] == [a1, a1 + env_part] and not tool_turn["error"]
    assert env.reward(PROMPT, tok.decode(ep.output_ids)) == 1.0
    ref = reference_trajectory(fmt, env, PROMPT)
    assert ref.ids == ep.ids and ref.loss_mask == ep.loss_mask  # the warm-up teaches exactly this episode


class Flaky:
    tools = [{"type": "function", "function": {"name": n}} for n in ("boom", "number", "flood")]
    max_turns = 8

    def call_tool(self, prompt, name, arguments):
        if name == "boom":
            raise RuntimeError("disk on fire")
        return 42 if name == "number" else "x" * 10_000

    def reward(self, prompt, completion):
        return 0.0


@pytest.mark.parametrize("name, says", [("boom", "error: the tool boom raised RuntimeError: disk on fire"),
                                        ("number", "error: the tool number returned int, not text"),
                                        ("nope", "error: unknown tool 'nope'"),
                                        ("flood", "[... cut at 4096 characters]")])
def test_failing_tools_become_error_results_in_the_trajectory(tok, name, says):
    call = {"function": {"name": name, "arguments": {}}}
    (ep,) = run_episodes(Scripted(tok, [format_tool_calls([call]), "done"]), PromptFormat.of(tok, Flaky()), Flaky(),
                         ["p"], _params(), max_tokens=10_000)
    result = next(m for m in ep.messages if m["role"] == "tool")["content"]
    assert says in result and ep.finish_reason == "answer"


def test_malformed_sections_and_limits(tok):
    env = load_env("tools-calc")
    fmt = PromptFormat.of(tok, env)
    (ep,) = run_episodes(Scripted(tok, ["<|tool_calls_section_begin|>oops", "1"]), fmt, env, [PROMPT], _params())
    user = [m for m in ep.messages if m["role"] == "user"][-1]["content"]
    assert "could not be read" in user and "never closed" in user
    # a model that calls forever stops at max_turns, with no environment tokens left dangling
    (ep,) = run_episodes(Scripted(tok, [format_tool_calls([CALL])]), fmt, env, [PROMPT], _params(), max_turns=2)
    assert ep.finish_reason == "max_turns" and ep.loss_mask[-1] == 1
    assert sum(t["role"] == "assistant" for t in ep.turns) == 2
    # the token budget caps turns and episodes
    (ep,) = run_episodes(Scripted(tok, [format_tool_calls([CALL])]), fmt, env, [PROMPT], _params(), max_tokens=40)
    assert len(ep.output_ids) <= 40 + 0 and ep.finish_reason in ("length", "max_tokens")
    with pytest.raises(ValueError, match="chat template"):
        run_episodes(Scripted(tok, ["x"]), PromptFormat.of(tok, env, mode="raw"), env, [PROMPT], _params())


def test_rollout_rows_of_an_agentic_env_train_through_their_mask(tok):
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.tables import rollout_table
    from k3core.rl.train import table_to_sequences
    from k3core.rl.weights import engine_from_model

    cfg = K3Config.preset("tiny").replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                          eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    model.reset_parameters(0)
    env = load_env("tools-calc")
    fmt = PromptFormat.of(tok, env)
    engine = engine_from_model(model.eval(), 0, quantized=False)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=2, seed=1, stop_token_ids=fmt.stop_ids)
    table = rollout_table(engine, fmt, [PROMPT, "Compute 999*888."], params, 0, episode_limits=EpisodeLimits(3, 80))
    rows = table.to_pylist()
    seqs = table_to_sequences(table, len(model.moe_layer_ids), cfg.num_experts_per_token)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r, s in zip(rows, seqs):
        assert s.loss_mask == r["loss_mask"] and len(r["loss_mask"]) == len(r["output_ids"])
        assert s.routing.shape[0] == len(r["prompt_ids"]) + len(r["output_ids"]) - 1  # every input position
        turns = json.loads(r["turns"])
        for t in turns:  # the mask is 1 on assistant spans and 0 on what the environment wrote
            lo, hi = t["span"]
            hi = min(hi, len(r["loss_mask"]))
            assert set(r["loss_mask"][lo:hi]) <= ({1} if t["role"] == "assistant" else {0})


def test_tool_use_metrics_and_the_trajectory_viewer(tok):
    """Two episodes with known shapes: one calls the calculator twice (one call malformed in its
    arguments, so the tool answers an error) then answers; one answers at once."""
    from k3core.rl.episodes import episode_stats, trajectories_markdown

    env = load_env("tools-calc")
    fmt = PromptFormat.of(tok, env)
    bad = {"function": {"name": "calculator", "arguments": {"expression": "12 apples"}}}
    calls = format_tool_calls([CALL, bad])
    eps = run_episodes(Scripted(tok, [calls, "56088"]), fmt, env, [PROMPT], _params())
    eps += run_episodes(Scripted(tok, ["56088"]), fmt, env, [PROMPT], _params())
    stats = episode_stats([json.dumps(e.turns) for e in eps], [e.loss_mask for e in eps],
                          [e.finish_reason for e in eps])
    assert stats["episode_turns"] == (2 + 1) / 2 and stats["tool_calls_per_episode"] == 2 / 2
    assert stats["tool_error_rate"] == 1 / 2 and stats["answered_fraction"] == 1.0
    assert stats["episode_tokens"] == sum(len(e.output_ids) for e in eps) / 2
    assert stats["trained_token_fraction"] == sum(sum(e.loss_mask) for e in eps) / sum(len(e.output_ids) for e in eps)
    assert episode_stats([None, None], [None, None], ["stop", "stop"]) == {}  # single-turn rows
    rows = [{"prompt": e.prompt, "prompt_index": 0, "sample_index": k, "turns": json.dumps(e.turns),
             "reward": env.reward(e.prompt, tok.decode(e.output_ids)), "finish_reason": e.finish_reason,
             "output_ids": e.output_ids, "loss_mask": e.loss_mask, "reward_reason": ""} for k, e in enumerate(eps)]
    md = trajectories_markdown(rows, "iteration 0")
    assert md.startswith("### iteration 0") and md.count("#### prompt 0") == 2
    assert "**tool** `calculator({\"expression\": \"123*456\"})`" in md and "    56088" in md
    assert "**error**" in md and "not an integer expression" in md and "reward 1.000" in md


class _Answered(Scripted):
    """``Scripted`` that counts the episodes that reached their answer turn (their second)."""

    def __init__(self, tok, turns, when_all, expected):
        super().__init__(tok, turns)
        self.answered, self.when_all, self.expected, self.lock = 0, when_all, expected, threading.Lock()

    def generate(self, prompts, params, **kw):
        out = super().generate(prompts, params, **kw)
        with self.lock:
            self.answered += sum(p.count(self.tok.special_ids["<|im_assistant|>"]) == 2 for p in prompts)
            if self.answered >= self.expected:
                self.when_all.set()
        return out


@pytest.mark.parametrize("schedule", ["continuous", "rounds"])
def test_an_episode_waiting_for_its_tool_holds_no_other(tok, schedule):
    """Episode 0's tool returns only once the three other episodes have answered. Under the
    continuous schedule they do, while it waits; under rounds they wait for it, so its wait runs out
    (after 1 s) and it reports that."""
    env = load_env("tools-calc")
    fmt = PromptFormat.of(tok, env)
    prompts = [f"Compute {100 + i}*2." for i in range(4)]
    others_answered = threading.Event()
    client = _Answered(tok, [format_tool_calls([CALL]), "1"], others_answered, expected=3)

    def tool(prompt, name, arguments):
        if prompt != prompts[0]:
            return env.call_tool(prompt, name, arguments)
        return "the others answered" if others_answered.wait(30 if schedule == "continuous" else 1) else "waited alone"

    eps = run_episodes(client, fmt, env, prompts, _params(), tool_runner=tool, tool_workers=4, schedule=schedule)
    result = next(t["result"] for t in eps[0].turns if t["role"] == "tool")
    assert result == ("the others answered" if schedule == "continuous" else "waited alone")
    assert all(ep.finish_reason == "answer" for ep in eps)


class _FirstTokenThenCall:
    """A policy on the real engine: each turn the engine samples one id (every id stops it, so the
    engine keeps the episode's decode state), then the turn goes on with a scripted calculator call
    (the answer ``1`` on the third turn) and the end-of-turn id, which the next turn prefills."""

    def __init__(self, engine, tok):
        self.engine, self.tok = engine, tok

    def generate(self, prompts, params, sessions=None):
        every = list(range(self.tok.vocab_size))
        real = self.engine.generate(prompts, replace(params, max_new_tokens=1, stop_token_ids=every), sessions=sessions)
        out = []
        for p, c in zip(prompts, real):
            k = p.count(self.tok.special_ids["<|im_assistant|>"]) - 1
            tail = self.tok.encode(format_tool_calls([CALL]) if k < 2 else "1") + [self.tok.special_ids["<|im_end|>"]]
            out.append(replace(c, output_ids=c.output_ids + tail, logprobs=c.logprobs + [0.0] * len(tail),
                               finish_reason="stop"))
        return out

    def release_sessions(self, sessions):
        return self.engine.release_sessions(sessions)


def test_the_schedule_changes_no_trajectory(tok):
    """The real tiny engine, one sequence at a time (so no batch shape differs), keeping each
    episode's decode state between its three turns: the continuous and rounds schedules sample the
    same ids with the same log-probabilities in every episode, as each episode's seeds derive from its
    position, sample and turn only; the per-token weight versions cover exactly the sampled ids."""
    from k3core.config import K3Config
    from k3core.model import K3ForCausalLM
    from k3core.rl.weights import engine_from_model

    cfg = K3Config.preset("tiny").replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                          eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    env = load_env("tools-calc")
    fmt = PromptFormat.of(tok, env)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, n=2, seed=5, stop_token_ids=fmt.stop_ids)
    runs = {}
    for schedule in ("rounds", "continuous"):
        torch.manual_seed(0)
        model = K3ForCausalLM(cfg)
        model.reset_parameters(0)
        engine = engine_from_model(model.eval(), 3, quantized=False)
        engine.max_batch = 1
        runs[schedule] = run_episodes(_FirstTokenThenCall(engine, tok), fmt, env, [PROMPT, "Compute 999*888."],
                                      params, max_turns=3, max_tokens=400, schedule=schedule)
        assert engine.stats["prefill_tokens"] < sum(len(e.ids) for e in runs[schedule])  # the kept state was used
        assert not engine.kept_sessions()["sessions"]  # and freed as each episode ended
    for a, b in zip(runs["rounds"], runs["continuous"]):
        assert sum(t["role"] == "tool" for t in b.turns) == 2 and b.finish_reason == "answer"
        assert a.ids == b.ids and a.logprobs == b.logprobs and a.loss_mask == b.loss_mask
        assert [v is not None for v in b.token_versions()] == [m == 1 for m in b.loss_mask]
        assert {v for v in b.token_versions() if v is not None} == {3}
    assert len({tuple(e.ids) for e in runs["continuous"]}) == 4  # four episodes, four different samples
