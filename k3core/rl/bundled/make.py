"""Make the bundled datasets of ``--env math`` and ``--env code`` (``k3core.rl.dataset_env``):

    python -m k3core.rl.bundled.make            # rewrites k3core/rl/bundled/math.jsonl and code.parquet

Both are small and seeded, for the demo and the tests; answers are short enough for the byte-level
presets' completion lengths. math.jsonl: arithmetic, fractions, linear equations and polynomial
expansions, whose answers the math verifier must read as mathematics (``5/6`` and ``0.833333`` are
both right for a fraction, ``x^2+5x+6`` and ``(x+2)*(x+3)`` for an expansion). code.parquet: one-line
Python function bodies, the prompt the function up to ``return ``, the tests ``[expression,
expected]`` pairs as a JSON string.
"""

from __future__ import annotations

import json
import random
import sys
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent


def math_rows(seed: int = 0, n: int = 240) -> list[dict]:
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        kind = rng.choice(("add", "sub", "mul", "frac", "solve", "expand"))
        if kind in ("add", "sub", "mul"):
            a, b = rng.randint(0, 30), rng.randint(0, 30)
            op = {"add": "+", "sub": "-", "mul": "*"}[kind]
            prompt, answer = f"{a}{op}{b}=", str(eval(f"{a}{op}{b}"))
        elif kind == "frac":
            p, q, r, s = rng.randint(1, 5), rng.randint(2, 6), rng.randint(1, 5), rng.randint(2, 6)
            v = Fraction(p, q) + Fraction(r, s)
            prompt, answer = f"{p}/{q}+{r}/{s}=", f"{v.numerator}/{v.denominator}" if v.denominator != 1 else str(v)
        elif kind == "solve":
            a, x, b = rng.randint(2, 6), rng.randint(-5, 9), rng.randint(-9, 9)
            prompt, answer = f"{a}x{'+' if b >= 0 else '-'}{abs(b)}={a * x + b}; x=", str(x)
        else:
            a, b = rng.randint(1, 5), rng.randint(1, 5)
            prompt, answer = f"(x+{a})(x+{b})=", f"x^2+{a + b}x+{a * b}"
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "answer": answer})
    return rows


_BODIES = [  # (the function's description, its body, argument values to test)
    ("x times {a} plus {b}", "x*{a}+{b}", [0, 1, 5, -3]),
    ("x squared plus {a}", "x*x+{a}", [0, 2, -4, 7]),
    ("the larger of x and {a}", "max(x,{a})", [0, 3, 10, -8]),
    ("x modulo {m}", "x%{m}", [0, 7, 13, 22]),
    ("x with {a} subtracted", "x-{a}", [0, 9, -2, 30]),
    ("x integer-divided by {m}", "x//{m}", [0, 7, 19, 40]),
]


def code_rows(seed: int = 0, n: int = 120) -> list[dict]:
    rng = random.Random(seed)
    rows, seen = [], set()
    for _ in range(100 * n):
        if len(rows) == n:
            return rows
        desc, body, xs = rng.choice(_BODIES)
        vals = {"a": rng.randint(1, 9), "b": rng.randint(0, 9), "m": rng.randint(2, 7)}
        desc, body = desc.format(**vals), body.format(**vals)
        prompt = f"# f(x) = {desc}\ndef f(x):\n    return "
        if prompt in seen:
            continue
        seen.add(prompt)
        scope: dict = {}
        exec(f"def f(x):\n    return {body}", scope)
        tests = [[f"f({x})", scope["f"](x)] for x in xs]
        rows.append({"prompt": prompt, "answer": body, "tests": json.dumps(tests)})
    raise ValueError(f"only {len(rows)} distinct code prompts, {n} asked for")


def write(out_dir: Path = HERE) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "math.jsonl", "w", encoding="utf-8") as f:
        for row in math_rows():
            f.write(json.dumps(row) + "\n")
    pq.write_table(pa.Table.from_pylist(code_rows()), out_dir / "code.parquet")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
