"""``code-agent``: the seed's coding agent scaled down to what a small model can do on a CPU.

Each task is a bundled ``code`` task (``k3core/rl/bundled/code.parquet``): a one-line function to
complete, ``# f(x) = x modulo 4\\ndef f(x):\\n    return ``, and its tests. An episode:
  1. the model writes the missing expression and calls ``run_tests({"expression": ...})``;
  2. the tool runs the program (stub + expression) against the tests, as a process of its own, and
     answers how many passed and the first failure (``f(7) -> 1, expected 3``);
  3. the model reads that, may fix the expression and call again, and submits by answering with the
     expression alone (a turn without a tool call);
  4. the reward is the fraction of tests the submitted expression passes.

The tool and the reward run model-written code, so this environment is not one of the built-ins
that run in process: its tools and rewards go through the reward sandbox (``k3core.rl.sandbox``),
one confined process per call. ``reference_turns`` (what the warm-up teaches) calls the tests on the
reference answer, then submits it.
"""

from __future__ import annotations

import json
import random
from functools import cached_property

from k3core.rl.dataset_env import BUNDLED, BUNDLED_DIR

__all__ = ["CodeAgentEnv"]


class CodeAgentEnv:
    name = "code-agent"
    max_turns = 4
    system_prompt = "Write the expression, check it with run_tests, then answer with the expression only."
    tools = [{"type": "function", "function": {
        "name": "run_tests", "description": "run the tests of f with this return expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}]

    @cached_property
    def tasks(self) -> dict[str, dict]:
        import pyarrow.parquet as pq

        rows = pq.read_table(BUNDLED_DIR / BUNDLED["code"]).to_pylist()
        return {r["prompt"]: {"answer": r["answer"], "tests": [tuple(t) for t in json.loads(r["tests"])]} for r in rows}

    def prepare(self) -> None:
        """In the sandbox worker, before it confines itself: the tasks, and the verifier's imports."""
        import k3core.rl.verifiers  # noqa: F401

        _ = self.tasks

    def prompts(self, rng: random.Random, n: int) -> list[str]:
        keys = sorted(self.tasks)
        return [rng.choice(keys) for _ in range(n)]

    def _task(self, prompt: str) -> dict:
        if prompt not in self.tasks:
            raise ValueError(f"code-agent: {prompt[:60]!r} is not one of its tasks")
        return self.tasks[prompt]

    def _run(self, prompt: str, expression: str) -> tuple[float, str]:
        from k3core.rl.verifiers import code_reward

        expression = expression.strip()
        if not expression or "\n" in expression:
            return 0.0, "error: give one expression on one line"
        return code_reward(prompt + expression + "\n", self._task(prompt)["tests"])

    def call_tool(self, prompt: str, name: str, arguments: dict) -> str:
        score, why = self._run(prompt, str(arguments.get("expression", "")))
        n = len(self._task(prompt)["tests"])
        return why if why.startswith("error:") else (why or f"{n}/{n} tests passed")

    def copied(self, prompt: str) -> str:
        """What an episode copies (the warm-up's copy phase repeats it): the numbers of the task's
        description, in order, as its expression writes them (``x times 5 plus 8`` -> ``5 8``; the
        words become operators, which the reference turns teach)."""
        import re

        return " ".join(re.findall(r"\d+", prompt.splitlines()[0]))

    def reference_turns(self, prompt: str) -> list[str]:
        from k3core.tokenizer.tool_calls import format_tool_calls

        answer = self._task(prompt)["answer"]
        return [format_tool_calls([{"function": {"name": "run_tests", "arguments": {"expression": answer}}}]), answer]

    def reward(self, prompt: str, completion: str) -> float:
        return self.judge(prompt, completion)[0]

    def judge(self, prompt: str, completion: str) -> tuple[float, str]:
        from k3core.tokenizer.tool_calls import final_answer

        score, why = self._run(prompt, final_answer(completion))
        return score, why
