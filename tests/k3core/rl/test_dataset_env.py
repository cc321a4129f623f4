"""Dataset environments and their verifiers: loading from Parquet and JSONL through fsspec (a local
path and memory://), refusing malformed tables with the problem named, the held-out split, seeded
epoch shuffling read at a position, the math verifier against hand-checked equivalences, the code
verifier against programs that pass, fail, break and hang (in the sandbox), and the bundled datasets
against the script that makes them."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from k3core.rl.data import heldout_prompts, is_heldout, training_prompts
from k3core.rl.dataset_env import BUNDLED_DIR, DatasetEnv, parse_spec
from k3core.rl.envs import load_env
from k3core.rl.rewards import score_completions
from k3core.rl.sandbox import SandboxLimits
from k3core.rl.verifiers import extract_answer, math_reward, read_math

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(12) for b in range(12)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_at_any_fsspec_url_give_the_same_environment(tmp_path):
    a = load_env(f"dataset:math:{_jsonl(tmp_path / 'd.jsonl', ROWS)}")
    with fsspec.open("memory://k3rl-test/d.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(ROWS), f)
    b = load_env("dataset:math:memory://k3rl-test/d.parquet")
    assert a.train == b.train and a.heldout == b.heldout
    assert sorted(a.train + a.heldout) == sorted(r["prompt"] for r in ROWS)
    assert all(map(is_heldout, a.heldout)) and not any(map(is_heldout, a.train))
    assert a.reference("3+4=") == "7"


@pytest.mark.parametrize("spec, says", [
    ("dataset:poetry:x.jsonl", "VERIFIER one of math, code"),
    ("dataset:math:", "dataset:VERIFIER:URL"),
    ("dataset:math:/no/such/file.jsonl", "cannot read /no/such/file.jsonl"),
    ("dataset:math:{tmp}/d.csv", "must end in .parquet or .jsonl"),
])
def test_a_bad_dataset_spec_names_the_fix(tmp_path, spec, says):
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=says):
        load_env(spec.format(tmp=tmp_path))


@pytest.mark.parametrize("rows, says", [
    ([{"prompt": "1+1="}], "row 0 has no answer"),
    ([{"question": "1+1=", "answer": "2"}], "row 0 has no prompt"),
    ([{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+1=", "answer": "3"}], "appears twice with different answers"),
    ([{"prompt": "1+1=", "answer": "2"}], "training and 0 held-out prompts"),
])
def test_a_malformed_table_is_refused_with_the_problem(tmp_path, rows, says):
    with pytest.raises(ValueError, match=says):
        load_env(f"dataset:math:{_jsonl(tmp_path / 'd.jsonl', rows)}")


def test_code_rows_need_tests(tmp_path):
    rows = [{"prompt": f"def f{i}():\n    return ", "answer": "1", "tests": "[]"} for i in range(3)]
    with pytest.raises(ValueError, match="tests must be a non-empty list"):
        load_env(f"dataset:code:{_jsonl(tmp_path / 'c.jsonl', rows)}")


def test_the_stream_is_every_training_row_once_per_epoch_in_a_seeded_order():
    env = DatasetEnv("math", ROWS, "t")
    rows = len(env.train)
    epoch0, epoch1 = env.prompts_at(0, 0, rows), env.prompts_at(0, rows, rows)
    assert sorted(epoch0) == sorted(epoch1) == sorted(env.train)  # each epoch: every row once
    assert epoch0 != epoch1 and epoch0 != env.train  # reshuffled per epoch, not file order
    assert env.prompts_at(1, 0, rows) != epoch0  # the seed picks the order
    # reading in pieces of any size, across the epoch boundary, gives the same stream
    pieces = [p for start in range(0, 2 * rows, 7) for p in env.prompts_at(0, start, min(7, 2 * rows - start))]
    assert pieces == epoch0 + epoch1
    # the pipeline's entry point reads the stream at the position; without one it draws as before
    assert training_prompts(env, 0, 5, 4, "t", position=10) == epoch0[10:14]
    assert heldout_prompts(env, 0, len(env.heldout) + 2, "t") == env.heldout + env.heldout[:2]


def test_math_answers_are_compared_as_mathematics():
    right = [("5/6", "5/6"), ("0.833333", "5/6"), ("10/12", "5/6"), ("2x+1", "2*x+1"), ("1 + 2*x", "2*x+1"),
             ("x^2+5x+6", "(x+2)*(x+3)"), ("(x+3)(x+2)", "x^2+5x+6"), ("sqrt(8)", "2*sqrt(2)"),
             ("the answer is \\boxed{7}", "7"), ("7.", "7"), ("7\nbecause", "7")]
    wrong = [("0.8", "5/6"), ("2x", "2*x+1"), ("x^2+5x", "x^2+5x+6"), ("8", "7"), ("", "7"), ("1/0", "7")]
    for got, want in right:
        assert math_reward(got, want)[0] == 1.0, (got, want)
    for got, want in wrong:
        assert math_reward(got, want)[0] == 0.0, (got, want)


def test_the_math_reader_refuses_anything_but_plain_mathematics():
    for text in ['__import__("os").system("true")', "x.__class__", "open", "lambda: 1", "[1]", "a_b", "'1'"]:
        assert read_math(text) is None, text
    assert extract_answer("so \\boxed{\\frac{1}{2}} and \\boxed{3}") == "3"
    assert math_reward("__import__('os')", "1") == (0.0, "answer \"__import__('os')\" is not readable as mathematics")
    with pytest.raises(ValueError, match="reference answer 'one half' is not mathematics"):
        math_reward("1/2", "one half")


CODE_TESTS = [["f(0)", 1], ["f(2)", 7], ["f(-1)", -2]]
PROMPT = "# f(x) = x times 3 plus 1\ndef f(x):\n    return "


@pytest.fixture
def code_env(tmp_path):
    rows = [{"prompt": PROMPT, "answer": "x*3+1", "tests": json.dumps(CODE_TESTS)}]
    rows += [{"prompt": f"# f{i}\ndef f(x):\n    return ", "answer": "x", "tests": [["f(1)", 1]]} for i in range(30)]
    return f"dataset:code:{_jsonl(tmp_path / 'code.jsonl', rows)}"


def test_code_is_judged_by_its_tests_in_the_sandbox(code_env):
    env = load_env(code_env)
    completions = ["x*3+1", "x*3", "x*3+", "x*3+1\nimport os\nos._exit(0)", "__import__('time').sleep(60)",
                   "(lambda: [0] * (10 ** 10))()", 'print(\'{"results": [{"value": 1}, {"value": 7}, {"value": -2}]}\') or 0']
    outs = score_completions(env, code_env, [PROMPT] * len(completions), completions,
                             SandboxLimits(timeout_s=3.0, workers=2))
    assert [o.reward for o in outs] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert outs[1].reason.startswith("0/3 tests passed; f(0) -> 0, expected 1")
    assert outs[2].reason.startswith("program raised SyntaxError")
    assert outs[3].reason.startswith("program gave no test results")  # exiting early is not passing
    assert outs[4].stopped and outs[4].reason.startswith("timeout:")  # the test call hangs: the sandbox stops it
    assert "MemoryError" in outs[5].reason
    assert outs[6].reason.startswith("0/3")  # printing results does not forge them


def test_the_bundled_datasets_are_what_their_script_makes(tmp_path):
    from k3core.rl.bundled.make import write

    write(tmp_path)
    assert (tmp_path / "math.jsonl").read_bytes() == (BUNDLED_DIR / "math.jsonl").read_bytes()
    assert pq.read_table(tmp_path / "code.parquet").to_pylist() == pq.read_table(BUNDLED_DIR / "code.parquet").to_pylist()
    assert parse_spec("math") == ("math", str(BUNDLED_DIR / "math.jsonl"))


@pytest.mark.parametrize("spec", ["math", "code"])
def test_every_bundled_reference_answer_scores_one(spec):
    env = load_env(spec)
    prompts = env.train + env.heldout
    outs = score_completions(env, spec, prompts, [env.reference(p) for p in prompts],
                             SandboxLimits(timeout_s=20.0, workers=2))
    assert [p for p, o in zip(prompts, outs) if o.reward != 1.0] == []


def test_a_code_program_sees_neither_the_dataset_nor_the_project(code_env, tmp_path):
    """The cheats of a program that knows where it runs: read the expected values from the dataset
    (the run's, or the one bundled with k3rl), import the project or a site package to find them, list
    the machine's files. Each scores 0 and says what refused it; an honest program still passes."""
    data = code_env.split(":", 2)[2]
    bundled = str(Path(__file__).resolve().parents[3] / "k3core" / "rl" / "bundled" / "code.parquet")
    env = load_env(code_env)
    cheats = [f"0\nopen({data!r}).read()", f"0\nopen({bundled!r}, 'rb').read(4)", "0\nimport k3core",
              "0\nimport pyarrow", "0\nimport os\nos.listdir('/etc')", "x*3+1"]
    outs = score_completions(env, code_env, [PROMPT] * len(cheats), cheats, SandboxLimits(timeout_s=5.0, workers=2))
    assert [o.reward for o in outs] == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0], [o.reason for o in outs]
    for o in outs[:2]:
        assert o.reason.startswith("program raised PermissionError"), o.reason
    assert [o.reason.split(":")[0] for o in outs[2:4]] == ["program raised ModuleNotFoundError"] * 2
    assert outs[4].reason.startswith("program raised PermissionError"), outs[4].reason
