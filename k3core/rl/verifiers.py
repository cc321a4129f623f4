"""Built-in verifiers of dataset environments: math answers and code with unit tests. Each returns
``(reward in [0, 1], reason)``; the reason says why a completion lost reward ('' when it did not).

Owns: reading a math answer out of a completion, deciding equivalence (sympy), running a program
against its tests. Does not own where this runs: dataset environments score in the reward sandbox
(``k3core.rl.sandbox``), which bounds time, memory, processes, files and network, so an answer such
as ``9^9^9`` or a program that loops is stopped there, not here.

Math (``math_reward``): the answer is the content of the last ``\\boxed{...}`` if any, else the
completion's first line, stripped (a trailing '.' dropped). It scores 1 when it equals the reference
as text, or as mathematics: both read by sympy and their difference simplifies to 0, or evaluates to
within 1e-6 (relative) of 0. Text is read only if it is made of digits, + - * / ^ ( ) . , spaces and
the names in ``MATH_NAMES`` (sympy's parser evaluates what it reads, so nothing else reaches it).
A reference answer that cannot be read is the dataset's fault: ``ValueError`` (the stage fails
naming the prompt).

Code (``code_reward``): the completion continues the prompt, so the program is prompt + completion.
It runs as its own process of the base interpreter with ``-I -S`` (inheriting the sandbox's limits:
the standard library only, no site-packages, no project package), confined to reading the
interpreter's tree, the system's libraries and its own directory (Landlock, ``confine_reads``),
defines its names, then each test expression is evaluated in its namespace; the result, as JSON,
must equal the test's expected value. Reward: the fraction of tests passed. The expected values
never enter the program's process, and the dataset that holds them is closed to it, so a program
cannot report passing without computing them.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile

MATH_NAMES = frozenset({"sqrt", "pi", "e", "E", "I", "log", "exp", "sin", "cos", "tan",
                        "a", "b", "c", "k", "m", "n", "t", "x", "y", "z"})
_MATH_CHARS = re.compile(r"[0-9A-Za-z+\-*/^().,\s]{1,120}")


def extract_answer(completion: str) -> str:
    """The answer a completion gives: the last ``\\boxed{...}`` content, else its first line."""
    i = completion.rfind("\\boxed{")
    if i >= 0:
        depth, j = 0, i + len("\\boxed{") - 1
        for k in range(j, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[k], 0)
            if depth == 0:
                return completion[j + 1:k].strip()
    first = completion.strip().split("\n", 1)[0].strip()
    return first[:-1].strip() if first.endswith(".") else first


def prepare_math() -> None:
    """Import and initialise what ``math_reward`` needs (sandbox workers call it once, before their
    calls fork): sympy builds much of its machinery on first use, which each forked call would
    otherwise repeat."""
    for got, want in (("2x+1", "1+2*x"), ("0.5", "1/2"), ("x^2+5x+6", "(x+2)(x+3)"), ("7", "sqrt(2)")):
        math_reward(got, want)


def read_math(text: str):
    """A sympy expression for ``text``, or None when it is not plain mathematics (see the module doc)."""
    text = text.strip()
    if not _MATH_CHARS.fullmatch(text) or "__" in text or re.search(r"\.[A-Za-z_]", text):
        return None
    if any(name not in MATH_NAMES for name in re.findall(r"[A-Za-z_]+", text)):
        return None
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                            standard_transformations)

    names = {n: sympy.Symbol(n) for n in MATH_NAMES if len(n) == 1 and n not in "eEI"}
    names.update(sqrt=sympy.sqrt, pi=sympy.pi, e=sympy.E, E=sympy.E, I=sympy.I, log=sympy.log, exp=sympy.exp,
                 sin=sympy.sin, cos=sympy.cos, tan=sympy.tan)
    try:
        expr = parse_expr(text, local_dict=names, global_dict={"__builtins__": {}, **_sympy_globals()},
                          transformations=standard_transformations + (implicit_multiplication_application,
                                                                      convert_xor))
    except (SyntaxError, TypeError, ValueError, AttributeError, ZeroDivisionError, sympy.SympifyError):
        return None
    return expr if isinstance(expr, sympy.Basic) else None


def _sympy_globals() -> dict:
    """The names sympy's parser emits into the code it evaluates (number and symbol constructors)."""
    import sympy

    return {"Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational, "Symbol": sympy.Symbol,
            "Function": sympy.Function}


def math_reward(completion: str, answer: str) -> tuple[float, str]:
    import sympy

    got = extract_answer(completion)
    if got == answer.strip():
        return 1.0, ""
    want = read_math(answer)
    if want is None:
        raise ValueError(f"the reference answer {answer!r} is not mathematics the math verifier reads "
                         f"(digits, + - * / ^ ( ) . and {sorted(MATH_NAMES)})")
    have = read_math(got)
    if have is None:
        return 0.0, f"answer {got[:40]!r} is not readable as mathematics"
    diff = have - want
    if sympy.simplify(diff) == 0:
        return 1.0, ""
    try:
        value = complex(sympy.N(diff))
    except (TypeError, ValueError):
        return 0.0, ""
    scale = max(1.0, abs(complex(sympy.N(want)))) if not want.free_symbols else 1.0
    close = diff.free_symbols == set() and math.isfinite(abs(value)) and abs(value) <= 1e-6 * scale
    return (1.0, "") if close else (0.0, "")


_HARNESS = r"""
import contextlib, io, json, sys
req = json.loads(sys.stdin.read())
out, ns = sys.stdout, {"__name__": "__program__"}
results = []
try:
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(req["program"], "<program>", "exec"), ns)
except BaseException as e:
    out.write(json.dumps({"program_error": f"{type(e).__name__}: {e}"[:300]}) + "\n")
    sys.exit(0)
for expr in req["tests"]:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            value = eval(expr, ns)
        json.dumps(value)
        results.append({"value": value})
    except BaseException as e:
        results.append({"error": f"{type(e).__name__}: {e}"[:300]})
out.write(json.dumps({"results": results}) + "\n")
"""


def program_command() -> list[str]:
    """The program's interpreter: the base interpreter (not a virtual environment's), isolated (-I:
    no PYTHON* variables, no user site) and without ``site`` (-S: no site-packages), so a program
    imports the standard library and nothing else, neither the project's packages nor its data."""
    return [getattr(sys, "_base_executable", None) or sys.executable, "-I", "-S", "-c", _HARNESS]


def _program_env() -> dict:
    return {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "HOME", "TMPDIR")}


def _confine_program() -> None:
    """In the program's process before its interpreter starts: it may read only the interpreter's own
    tree (binary and standard library), the system's shared libraries and its working directory
    (``k3core.rl.landlock.confine_reads``): the dataset, the project and the rest of the machine are
    closed to it, whatever its uid may read."""
    from k3core.rl.landlock import confine_reads

    base = getattr(sys, "_base_executable", None) or sys.executable
    confine_reads([sys.base_prefix, sys.base_exec_prefix, os.path.realpath(base), os.getcwd()])


def code_reward(program: str, tests: list[tuple[str, object]]) -> tuple[float, str]:
    """Run ``program`` as a process of its own and evaluate each ``(expression, expected)`` test."""
    if not tests:
        raise ValueError("a code prompt has no tests: every row needs at least one [expression, expected] pair")
    request = json.dumps({"program": program, "tests": [t[0] for t in tests]})
    with tempfile.TemporaryFile(dir=os.getcwd()) as out:  # bounded by the sandbox's file-size limit; no name left
        proc = subprocess.run(program_command(), input=request.encode(), stdout=out, stderr=subprocess.DEVNULL,
                              cwd=os.getcwd(), preexec_fn=_confine_program, env=_program_env())
        out.seek(0)
        text = out.read(1 << 20).decode(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    try:
        final = json.loads(lines[-1]) if lines else {}
    except ValueError:
        final = {}
    if "program_error" in final:
        return 0.0, f"program raised {final['program_error']}"
    results = final.get("results")
    if not isinstance(results, list) or len(results) != len(tests):
        why = (f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}")
        return 0.0, f"program gave no test results ({why})"
    passed, first = 0, ""
    for (expr, expected), got in zip(tests, results):
        if "value" in got and got["value"] == expected:
            passed += 1
        elif not first:
            first = f"{expr} -> {got.get('error') or repr(got.get('value'))[:60]}, expected {expected!r}"
    return passed / len(tests), ("" if passed == len(tests) else f"{passed}/{len(tests)} tests passed; {first}")
