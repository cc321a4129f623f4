"""Dataset environments: prompts and answers read from a Parquet or JSONL file at any fsspec URL,
scored by a built-in verifier (``k3core.rl.verifiers``: ``math`` or ``code``).

Owns: reading and checking the table, the held-out split, and the training stream's order. Does not
own where rewards run (always the sandbox, ``k3core.rl.rewards``) or the cursor's storage (the
trainer state's ``extra['data_cursor']``, written by the train stage).

Spec: ``dataset:VERIFIER:URL`` (``dataset:math:s3://bucket/algebra.parquet``,
``dataset:code:./my_tests.jsonl``), or ``math`` / ``code`` for the datasets bundled with k3rl
(``k3core/rl/bundled/``, made by ``python -m k3core.rl.bundled.make``).

Columns: ``prompt`` and ``answer`` (strings), and for ``code`` also ``tests``: a list of
``[expression, expected]`` pairs (or that list as a JSON string), the expected value as JSON.
For ``code`` the answer is a reference completion (used by the warm-up), and the program judged is
prompt + completion.

Order. Rows whose prompt ``k3core.rl.data.is_heldout`` are the held-out set (the same 1-in-8 hash
split as every environment); the rest are the training stream: epoch ``e`` is the training rows in
the order of a shuffle seeded by (seed, e), and the prompts at stream position ``p`` onwards are
epoch ``p // rows``, from row ``p % rows``, running into the next epoch. A run keeps its position
(the data cursor) in each trainer state, so a resumed run reads exactly the prompts an uninterrupted
one would, however many dynamic-sampling rounds each iteration drew.
"""

from __future__ import annotations

import json
import random
from functools import cached_property
from pathlib import Path

VERIFIERS = ("math", "code")
BUNDLED = {"math": "math.jsonl", "code": "code.parquet"}
BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"


def parse_spec(spec: str) -> tuple[str, str] | None:
    """(verifier, url) for a dataset spec, None for any other spec; a malformed dataset spec raises."""
    if spec in BUNDLED:
        return spec, str(BUNDLED_DIR / BUNDLED[spec])
    if not spec.startswith("dataset:"):
        return None
    verifier, sep, url = spec[len("dataset:"):].partition(":")
    if not sep or verifier not in VERIFIERS or not url:
        raise ValueError(f"environment {spec!r}: a dataset environment is dataset:VERIFIER:URL with VERIFIER one of "
                         f"{', '.join(VERIFIERS)} and URL a .parquet or .jsonl file (a path or any fsspec URL), "
                         "e.g. dataset:math:data/algebra.jsonl")
    return verifier, url


def read_rows(url: str, spec: str) -> list[dict]:
    """The table at ``url`` (.parquet, or .jsonl: one JSON object per line) as a list of rows."""
    import fsspec

    lower = url.lower().split("?", 1)[0]
    try:
        if lower.endswith(".parquet"):
            import pyarrow.parquet as pq

            with fsspec.open(url, "rb") as f:
                return pq.read_table(f).to_pylist()
        if lower.endswith((".jsonl", ".json")):
            with fsspec.open(url, "rt", encoding="utf-8") as f:
                rows = []
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except ValueError as e:
                            raise ValueError(f"environment {spec!r}: line {n} of {url} is not JSON ({e})") from e
                return rows
    except (FileNotFoundError, OSError) as e:
        raise ValueError(f"environment {spec!r}: cannot read {url} ({type(e).__name__}: {e})") from e
    raise ValueError(f"environment {spec!r}: {url} must end in .parquet or .jsonl")


class DatasetEnv:
    """A dataset environment (see the module doc). ``rows``: dicts with ``prompt``, ``answer`` and,
    for ``code``, ``tests``."""

    def __init__(self, verifier: str, rows: list[dict], spec: str):
        from k3core.rl.heldout import is_heldout

        self.verifier, self.spec, self.name = verifier, spec, f"dataset:{verifier}"
        problems, by_prompt = [], {}
        need = ("prompt", "answer", "tests") if verifier == "code" else ("prompt", "answer")
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                problems.append(f"row {i} is not a record")
                continue
            missing = [c for c in need if row.get(c) is None]
            if missing:
                problems.append(f"row {i} has no {', '.join(missing)}")
                continue
            if not isinstance(row["prompt"], str) or not row["prompt"] or not isinstance(row["answer"], str):
                problems.append(f"row {i}: prompt must be a non-empty string and answer a string")
                continue
            item = {"answer": row["answer"]}
            if verifier == "code":
                tests = _tests(row["tests"])
                if tests is None:
                    problems.append(f"row {i}: tests must be a non-empty list of [expression, expected] pairs")
                    continue
                item["tests"] = tests
            if row["prompt"] in by_prompt and by_prompt[row["prompt"]] != item:
                problems.append(f"row {i}: prompt {row['prompt']!r} appears twice with different answers")
            by_prompt[row["prompt"]] = item
            if len(problems) >= 10:
                break
        if problems:
            raise ValueError(f"environment {spec!r}: the dataset is not usable ({len(problems)} problem(s)): "
                             + "; ".join(problems))
        self._rows = by_prompt
        self.train = [p for p in by_prompt if not is_heldout(p)]
        self.heldout = [p for p in by_prompt if is_heldout(p)]
        if not self.train or not self.heldout:
            raise ValueError(f"environment {spec!r}: {len(by_prompt)} distinct prompts give {len(self.train)} training "
                             f"and {len(self.heldout)} held-out prompts (1 in 8 by a hash of the text); both must be "
                             "non-empty: add rows")

    # -------------------------------------------------------------- the environment protocol
    def prompts(self, rng: random.Random, n: int) -> list[str]:
        """``n`` prompts drawn at random from all rows (the warm-up's draw; the training stream is
        ``prompts_at``)."""
        pool = self.train + self.heldout
        return [pool[rng.randrange(len(pool))] for _ in range(n)]

    def reference(self, prompt: str) -> str:
        return self._row(prompt)["answer"]

    def reward(self, prompt: str, completion: str) -> float:
        return self.judge(prompt, completion)[0]

    def judge(self, prompt: str, completion: str) -> tuple[float, str]:
        """(reward, why it lost reward) from the verifier."""
        from k3core.rl import verifiers

        row = self._row(prompt)
        if self.verifier == "math":
            return verifiers.math_reward(completion, row["answer"])
        return verifiers.code_reward(prompt + completion, row["tests"])

    def prepare(self) -> None:
        """Imports for the verifier, once per sandbox worker before its calls fork."""
        if self.verifier == "math":
            from k3core.rl.verifiers import prepare_math

            prepare_math()

    # -------------------------------------------------------------- the data cursor
    def prompts_at(self, seed: int, position: int, n: int) -> list[str]:
        """The ``n`` training prompts at stream ``position`` (see the module doc)."""
        out, rows = [], len(self.train)
        for p in range(position, position + n):
            out.append(self._epoch(seed, p // rows)[p % rows])
        return out

    def heldout_prompts(self, n: int) -> list[str]:
        """``n`` held-out prompts: the held-out rows in file order, repeated if there are fewer."""
        return [self.heldout[i % len(self.heldout)] for i in range(n)]

    def _epoch(self, seed: int, epoch: int) -> list[str]:
        cache = self._epochs
        if (seed, epoch) not in cache:
            order = list(self.train)
            random.Random(f"dataset:{seed}:epoch{epoch}").shuffle(order)
            cache.clear()  # one epoch at a time is all a run reads
            cache[(seed, epoch)] = order
        return cache[(seed, epoch)]

    @cached_property
    def _epochs(self) -> dict:
        return {}

    def _row(self, prompt: str) -> dict:
        try:
            return self._rows[prompt]
        except KeyError:
            raise ValueError(f"environment {self.spec!r}: prompt {prompt!r} is not in the dataset") from None


def _tests(value) -> list[tuple[str, object]] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, list) or not value:
        return None
    out = []
    for t in value:
        if not isinstance(t, (list, tuple)) or len(t) != 2 or not isinstance(t[0], str):
            return None
        out.append((t[0], t[1]))
    return out


def load_dataset_env(spec: str) -> DatasetEnv | None:
    """The dataset environment of ``spec``, or None when ``spec`` is not a dataset spec."""
    parsed = parse_spec(spec)
    if parsed is None:
        return None
    verifier, url = parsed
    return DatasetEnv(verifier, read_rows(url, spec), spec)
