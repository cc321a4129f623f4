"""The ``code-agent`` environment end to end through the sandbox: an episode writes a wrong
expression, reads the failing test from ``run_tests``, fixes it and submits; the trajectory holds
both tool results as the model read them, and the reward (run confined, like the tool) is the share
of tests the submitted expression passes. Its code never runs in the pipeline's process."""

from __future__ import annotations

import pytest

from k3core.rl.envs import load_env
from k3core.rl.episodes import EpisodeLimits, final_answer, reference_trajectory, run_episodes, tools_of
from k3core.rl.prompting import PromptFormat
from k3core.rl.rewards import in_process, score_completions
from k3core.rl.sandbox import SandboxLimits
from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer
from k3core.tokenizer.tool_calls import format_tool_calls

from tests.k3core.rl.test_episodes import Scripted, _params

TASK = "# f(x) = x modulo 4\ndef f(x):\n    return "


def _tests(expr):
    return format_tool_calls([{"function": {"name": "run_tests", "arguments": {"expression": expr}}}])


def test_an_episode_reads_the_failures_fixes_and_submits():
    env = load_env("code-agent")
    assert TASK in env.tasks and not in_process("code-agent", SandboxLimits())
    tok = load_tokenizer(BUNDLED_K3_BPE)
    fmt = PromptFormat.of(tok, env)
    client = Scripted(tok, [_tests("x%3"), _tests("x%4"), "x%4"])
    with tools_of(env, "code-agent", EpisodeLimits(tool_timeout=10.0)) as (runner, workers):
        (ep,) = run_episodes(client, fmt, env, [TASK], _params(max_new=200), max_turns=4, max_tokens=2000,
                             tool_runner=runner, tool_workers=workers)
    results = [t["result"] for t in ep.turns if t["role"] == "tool"]
    assert results == ["2/4 tests passed; f(7) -> 1, expected 3", "4/4 tests passed"]
    assert ep.finish_reason == "answer" and final_answer(tok.decode(ep.output_ids)) == "x%4"
    assert "f(7) -> 1, expected 3" in tok.decode(ep.output_ids)  # the model's next turn was sampled after reading it
    texts = [tok.decode(ep.output_ids)] * 3
    texts[1] = texts[1].replace("assistant<|im_middle|>x%4<|im_end|>", "assistant<|im_middle|>x%2<|im_end|>")
    texts[2] = texts[2].replace("assistant<|im_middle|>x%4<|im_end|>", "assistant<|im_middle|>x +<|im_end|>")
    outcomes = score_completions(env, "code-agent", [TASK] * 3, texts, SandboxLimits(timeout_s=10.0))
    assert [o.reward for o in outcomes] == [1.0, 0.5, 0.0]
    assert "program raised SyntaxError" in outcomes[2].reason
    ref = reference_trajectory(fmt, env, TASK)  # what the warm-up teaches: check, then submit the answer
    assert final_answer(tok.decode(ref.output_ids)) == "x%4" and "4/4 tests passed" in tok.decode(ref.output_ids)


def test_an_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="not one of its tasks"):
        load_env("code-agent").call_tool("# f(x) = nothing", "run_tests", {"expression": "1"})


def test_what_an_episode_copies_is_the_descriptions_numbers_as_the_answer_writes_them():
    """``copied`` (the warm-up's copy phase): the numbers of the task's description in order, each of
    which the reference expression writes, in the same order (checked on every bundled task)."""
    from k3core.rl.code_agent import CodeAgentEnv

    env = CodeAgentEnv()
    assert env.copied("# f(x) = x times 5 plus 8\ndef f(x):\n    return ") == "5 8"
    for prompt, task in env.tasks.items():
        numbers, answer, at = env.copied(prompt).split(), task["answer"], 0
        assert numbers, prompt
        for n in numbers:
            at = answer.index(n, at) + len(n)  # ValueError: a number the answer does not write, in order
