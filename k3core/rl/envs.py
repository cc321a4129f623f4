"""Verifiable environments: the public protocol, the built-ins, and loading user environments.

An environment is any object with
  ``prompts(rng: random.Random, n: int) -> list[str]``   n prompts drawn with the given RNG
  ``reward(prompt: str, completion: str) -> float``       exact, deterministic, in [0, 1]
and optionally ``name`` and ``reference(prompt) -> str`` (a correct completion, used by the
supervised warm-up). Load one with ``load_env("add")`` (built-in) or
``load_env("my_pkg.my_mod:make_env")`` (any importable factory returning such an object).

Rewards are checked at the edge (``checked_reward``): NaN, out-of-range or raising rewards fail
loudly with the environment's name and the offending prompt, never silently.
"""

from __future__ import annotations

import importlib
import math
import random
import re
from typing import Protocol, runtime_checkable


@runtime_checkable
class Environment(Protocol):
    def prompts(self, rng: random.Random, n: int) -> list[str]: ...

    def reward(self, prompt: str, completion: str) -> float: ...


class AdditionEnv:
    """``"a+b="`` -> the decimal sum. Reward 1 for the exact sum, else 0. Held-out prompts come from
    a different RNG stream (see ``heldout_prompts``)."""

    name = "add"

    def __init__(self, max_operand: int = 49):
        self.max_operand = max_operand

    def prompts(self, rng: random.Random, n: int) -> list[str]:
        return [f"{rng.randint(0, self.max_operand)}+{rng.randint(0, self.max_operand)}=" for _ in range(n)]

    @staticmethod
    def _parse(prompt: str) -> tuple[int, int]:
        a, b = prompt.rstrip("=").split("+")
        return int(a), int(b)

    def reference(self, prompt: str) -> str:
        a, b = self._parse(prompt)
        return str(a + b)

    def reward(self, prompt: str, completion: str) -> float:
        return 1.0 if completion.strip() == self.reference(prompt) else 0.0


class ReverseEnv:
    """``"rev:abcd="`` -> ``"dcba"``. Reward: positions right divided by the longer length (1 only
    for the exact reversal)."""

    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 6, alphabet: str = "abcdefgh"):
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet

    def prompts(self, rng: random.Random, n: int) -> list[str]:
        out = []
        for _ in range(n):
            k = rng.randint(self.min_len, self.max_len)
            out.append("rev:" + "".join(rng.choice(self.alphabet) for _ in range(k)) + "=")
        return out

    def reference(self, prompt: str) -> str:
        return prompt[len("rev:"):-1][::-1]

    def reward(self, prompt: str, completion: str) -> float:
        target = self.reference(prompt)
        c = completion.strip()
        if not c and not target:
            return 1.0
        right = sum(1 for x, y in zip(c, target) if x == y)
        return right / max(len(c), len(target))


class ToolsCalcEnv:
    """Agentic (``k3core.rl.episodes``): ``"Compute A*B."`` with A, B of 3 digits, too large for a
    small model to multiply alone, and a ``calculator`` tool. The episode's answer is its last
    assistant turn; reward: positions right divided by the longer length (1 only for the exact
    product), like ``reverse``. ``reference_turns``: call the calculator, then answer its result."""

    name = "tools-calc"
    max_turns = 3
    system_prompt = "Use the calculator, then answer with the number only."
    tools = [{"type": "function", "function": {
        "name": "calculator", "description": "integer arithmetic: + - *",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

    def prompts(self, rng: random.Random, n: int) -> list[str]:
        return [f"Compute {rng.randint(100, 999)}*{rng.randint(100, 999)}." for _ in range(n)]

    @staticmethod
    def _operands(prompt: str) -> tuple[int, int]:
        a, b = prompt.removeprefix("Compute ").rstrip(".").split("*")
        return int(a), int(b)

    def call_tool(self, prompt: str, name: str, arguments: dict) -> str:
        expr = str(arguments.get("expression", "")).replace(" ", "")
        if not expr or not re.fullmatch(r"\d+([+*-]\d+)*", expr) or len(expr) > 64:
            return f"error: {expr!r} is not an integer expression of digits and + - *"
        total, term, op = 0, 1, "+"
        for tok in re.findall(r"\d+|[+*-]", expr):  # * before + and -, left to right
            if tok in "+-*":
                if tok != "*":
                    total, term = total + (term if op == "+" else -term), 1
                    op = tok
                continue
            term *= int(tok)
        return str(total + (term if op == "+" else -term))

    def copied(self, prompt: str) -> str:
        """What an episode copies (the warm-up's copy phase repeats it): the operands, as its call writes them."""
        a, b = self._operands(prompt)
        return f"{a}*{b}"

    def reference_turns(self, prompt: str) -> list[str]:
        from k3core.tokenizer.tool_calls import format_tool_calls

        a, b = self._operands(prompt)
        call = {"function": {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}}
        return [format_tool_calls([call]), str(a * b)]

    def reward(self, prompt: str, completion: str) -> float:
        from k3core.tokenizer.tool_calls import final_answer

        a, b = self._operands(prompt)
        target, c = str(a * b), final_answer(completion)
        right = sum(1 for x, y in zip(c, target) if x == y)
        return right / max(len(c), len(target))


BUILTIN_ENVS = {"add": AdditionEnv, "reverse": ReverseEnv, "tools-calc": ToolsCalcEnv}


def load_env(spec: str):
    """A built-in name (``add``, ``reverse``, ``tools-calc``; ``code-agent``, whose tools and rewards
    run in the sandbox), a dataset (``dataset:math|code:URL``, or ``math`` /
    ``code`` for the bundled ones: ``k3core.rl.dataset_env``) or ``module.path:factory`` (called with
    no arguments)."""
    from k3core.rl.dataset_env import load_dataset_env

    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]()
    if spec == "code-agent":  # bundled, but it runs model-written code: sandboxed like a user's
        from k3core.rl.code_agent import CodeAgentEnv

        return CodeAgentEnv()
    dataset = load_dataset_env(spec)
    if dataset is not None:
        return dataset
    if ":" not in spec:
        raise ValueError(f"unknown environment {spec!r}: use a built-in ({', '.join(sorted(BUILTIN_ENVS))}, code-agent), a "
                         "dataset (math, code, or dataset:math|code:URL) or 'module.path:factory' for your own")
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"environment {spec!r}: expected 'module.path:factory' with both parts named")
    # The module and its factory are the user's code: whatever they raise (a syntax error, an
    # exception or sys.exit at import) is bad input named here, not a traceback out of the CLI.
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name != mod_name and not mod_name.startswith(f"{e.name}."):
            raise ValueError(f"environment {spec!r}: module {mod_name!r} imports {e.name!r}, which is not installed; "
                             "install it or remove the import") from e
        raise ValueError(f"environment {spec!r}: cannot import module {mod_name!r} ({e}); is it on PYTHONPATH?") from e
    except SyntaxError as e:
        raise ValueError(f"environment {spec!r}: module {mod_name!r} has a syntax error ({e.msg}, {e.filename} line "
                         f"{e.lineno}); fix the module") from e
    except (Exception, SystemExit) as e:
        raise ValueError(f"environment {spec!r}: importing module {mod_name!r} raised {type(e).__name__}: {e}; "
                         "fix the module (it runs at import, before any stage)") from e
    if not hasattr(mod, attr):
        raise ValueError(f"environment {spec!r}: module {mod_name!r} has no attribute {attr!r}; define it there or "
                         "name the factory after the ':'")
    factory = getattr(mod, attr)
    if callable(factory) and not isinstance(factory, Environment):
        try:
            env = factory()
        except (Exception, SystemExit) as e:
            raise ValueError(f"environment {spec!r}: {mod_name}.{attr}() raised {type(e).__name__}: {e}; fix the "
                             "factory (it is called with no arguments)") from e
    else:
        env = factory
    if not isinstance(env, Environment):
        lacks = [m for m in ("prompts", "reward") if not callable(getattr(env, m, None))]
        raise ValueError(f"environment {spec!r} must provide prompts(rng, n) and reward(prompt, completion); "
                         f"{mod_name}.{attr}{'()' if callable(factory) else ''} gave a {type(env).__name__} without "
                         f"{' and '.join(lacks) or 'them'}")
    return env


def env_name(env, spec: str) -> str:
    return getattr(env, "name", None) or spec


def checked_prompts(env, rng: random.Random, n: int, spec: str = "?") -> list[str]:
    ps = env.prompts(rng, n)
    if not isinstance(ps, list) or len(ps) == 0:
        raise ValueError(f"environment {spec!r} returned no prompts (asked for {n}); it must return a non-empty list of str")
    if not all(isinstance(p, str) and p for p in ps):
        raise ValueError(f"environment {spec!r} returned a prompt that is not a non-empty str")
    return ps


class RewardError(ValueError):
    """The environment's reward function failed (raised, exited): a bug in its code, which a retry
    would only repeat (a ``ValueError``, so stages fail at once instead of retrying)."""


def checked_reward(env, prompt: str, completion: str, spec: str = "?") -> float:
    try:
        r = env.reward(prompt, completion)
    except (Exception, SystemExit) as e:  # the environment's bug, reported with its input; an exit is one too
        raise RewardError(f"environment {spec!r} raised {type(e).__name__}: {e} while scoring prompt {prompt!r} "
                          f"completion {completion!r}") from e
    try:
        r = float(r)
    except (TypeError, ValueError) as e:
        raise ValueError(f"environment {spec!r} returned a non-numeric reward {r!r} for prompt {prompt!r}") from e
    if math.isnan(r) or not 0.0 <= r <= 1.0:
        raise ValueError(f"environment {spec!r} returned reward {r!r} for prompt {prompt!r}: rewards must lie in [0, 1]")
    return r
