"""Tools of a user agentic environment run in the reward sandbox: each call a confined process with
the tool timeout, so a tool that hangs, raises, returns non-text, floods its output, writes outside
its directory, connects to a port listening here or kills its process becomes an ``error:`` result
the model reads in its trajectory, and the rollout goes on; the escape does not happen, and a good
call in the same worker still works. Real worker processes against the real kernel."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from k3core.rl.episodes import MAX_TOOL_RESULT_CHARS, EpisodeLimits, run_episodes, tools_of
from k3core.rl.prompting import PromptFormat
from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer
from k3core.tokenizer.tool_calls import format_tool_calls

from tests.k3core.rl.test_episodes import Scripted, _params

SPEC = "hostile_tool_env:make"
TESTS = str(Path(__file__).resolve().parents[2])
LIMITS = EpisodeLimits(tool_timeout=2.0, tool_workers=2)


@pytest.fixture(scope="module")
def env():
    sys.path.insert(0, TESTS)
    try:
        import hostile_tool_env

        yield hostile_tool_env.make()
    finally:
        sys.path.remove(TESTS)


def _call(what, arg=""):
    return format_tool_calls([{"function": {"name": "act", "arguments": {"what": what, "arg": arg}}}])


def test_every_failing_tool_becomes_an_error_result_and_the_rollout_goes_on(env, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    target = tmp_path / "escaped.txt"
    cases = [("hang", "", "was stopped (timeout: the tool call ran past 2 s"),
             ("raise", "", "raised KeyError"),
             ("number", "", "returned int, not text"),
             ("write", str(target), "was stopped (filesystem"),
             ("connect", str(listener.getsockname()[1]), "was stopped (network"),
             ("exit", "", "exited (status 3)"),
             ("flood", "", None),
             ("ok", "now", None)]
    tok = load_tokenizer(BUNDLED_K3_BPE)
    fmt = PromptFormat.of(tok, env)
    prompts = [f"Compute {i}*2." for i in range(len(cases))]
    # every episode calls its case's tool, then answers; the episodes' calls run two at a time

    class PerPrompt:
        """Episode i calls case i's tool, then answers."""

        def generate(self, prompts_ids, params, **_):
            out = []
            for p in prompts_ids:
                what, arg, _ = cases[next(i for i, q in enumerate(prompts) if q in tok.decode(p))]
                out += Scripted(tok, [_call(what, arg), "7"]).generate([p], params)
            return out

    with tools_of(env, SPEC, LIMITS) as (runner, workers):
        assert workers == 2
        eps = run_episodes(PerPrompt(), fmt, env, prompts, _params(max_new=400), max_turns=3,
                           max_tokens=20000, tool_runner=runner, tool_workers=workers)
    listener.close()
    for ep, (what, _, says) in zip(eps, cases):
        (rec,) = [t for t in ep.turns if t["role"] == "tool"]
        assert ep.finish_reason == "answer", what
        if says is None:
            assert rec["error"] == "", what
        else:
            assert rec["error"].startswith("error: the tool act ") and says in rec["error"], (what, rec["error"])
            assert rec["result"] == rec["error"]
    flood = next(t for t in eps[6].turns if t["role"] == "tool")["result"]
    assert len(flood) < MAX_TOOL_RESULT_CHARS + 100 and flood.endswith(f"[... cut at {MAX_TOOL_RESULT_CHARS} characters]")
    assert next(t for t in eps[7].turns if t["role"] == "tool")["result"] == "done now in True"
    assert not target.exists()
    assert max(t["seconds"] for ep in eps for t in ep.turns if t["role"] == "tool") < 10  # the hang was cut at 2 s


def test_builtin_environments_tools_run_in_process(env):
    from k3core.rl.envs import ToolsCalcEnv

    calc = ToolsCalcEnv()
    with tools_of(calc, "tools-calc", LIMITS) as (runner, workers):
        assert workers == 1 and runner("Compute 2*3.", "calculator", {"expression": "2*3"}) == "6"
    with tools_of(env, None, LIMITS) as (runner, workers):  # an environment object no spec loads
        assert workers == 1 and runner("p", "act", {"what": "ok", "arg": "x"}).startswith("done x")
