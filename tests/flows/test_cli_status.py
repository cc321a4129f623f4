"""``k3rl status`` (text and ``--json``) against run artifacts written by the pipeline's own writers
(``reports.publish_iteration`` / ``reports.summary`` for metrics.json and summary.json,
``tasks.save.save_checkpoint`` for latest.json), ``model-info --json`` against the library, the
CLI's exit codes and ``--help`` examples, and the UI markdown of ``flows/reports.py`` (lineage,
checkpoints). No Prefect server, no model: a few seconds."""

from __future__ import annotations

import dataclasses
import json
import re
import os
from pathlib import Path

import pytest

from flows import reports
from flows.cli import build_parser, main
from flows.pipeline import RLSettings
from flows.status import run_status
from k3core.artifacts import Artifact
from tasks.common import Run
from tasks.save import save_checkpoint

# held-out evaluations at iterations 0 and 2 (eval_every 2); the final evaluation (summary.json)
# scores the weights after the last iteration.
HISTORY = [
    {"iteration": 0, "weight_version": 0, "reward_mean": 0.25, "heldout_reward": 0.30, "heldout_solved": 0.0,
     "heldout_greedy_reward": 0.5},
    {"iteration": 1, "weight_version": 1, "reward_mean": 0.50},
    {"iteration": 2, "weight_version": 2, "reward_mean": 0.40, "heldout_reward": 0.55, "heldout_solved": 0.1,
     "heldout_greedy_reward": 0.5},
]
FINAL = {"heldout_reward": 0.45, "heldout_solved": 0.1, "heldout_greedy_reward": 0.75}


def _fake_run(root: Path, run_id: str, done: int, finished: bool) -> dict:
    """A run's artifacts as the pipeline writes them, after ``done`` iterations."""
    s = RLSettings.from_dict(dict(artifacts=str(root), run_id=run_id, iterations=len(HISTORY)))
    uri = f"file://{root}/runs/{run_id}"
    prep = [Artifact("hf", f"{uri}/source", "", "a" * 64, 0, {"source": "init:tiny:0"}, "fetch_checkpoint"),
            Artifact("report", f"{uri}/source.validation.json", "", "d" * 64, None, {}, "validate_checkpoint"),
            Artifact("hf", f"{uri}/warmup", "", "b" * 64, 0, {}, "warmup", (f"{uri}/source",)),
            Artifact("hf-mxfp4", f"{uri}/rollout-weights-v0", "", "c" * 64, 0, {}, "quantize_mxfp4")]
    lineage = list(prep)
    run = Run(str(root), run_id)
    for n in range(done):
        state = root / "trained" / f"v{n + 1}"
        state.mkdir(parents=True)
        (state / "model.bin").write_bytes(bytes([n]) * 16)
        trained = Artifact("dcp", f"{uri}/iter-{n:04d}/trainer", str(state), "e" * 64, n + 1)
        ck = save_checkpoint.fn(run, n, trained)
        lineage.append(dataclasses.replace(ck, produced_by=f"save_checkpoint-iter{n}", inputs=(trained.uri,)))
        reports.publish_iteration(s, HISTORY[: n + 1], lineage)
    if finished:
        reports.summary(s, {"fetch": 1.0}, HISTORY[:done], FINAL, wall=12.5)
    return {"settings": s, "prep": prep, "lineage": lineage}


def test_status_json_and_text_agree_with_the_artifacts(tmp_path, capsys):
    _fake_run(tmp_path, "r1", done=3, finished=True)
    run_dir = tmp_path / "runs" / "r1"
    assert main(["status", "--run-id", "r1", "--artifacts", str(tmp_path), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    latest = json.loads((run_dir / "latest.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert st["iterations_done"] == latest["iteration"] == 3
    assert st["latest_checkpoint"] == latest["checkpoint"] and st["latest_checkpoint"].endswith("checkpoints/iter-0003")
    assert st["weight_version"] == latest["version"] == 3
    # held-out: v0 0.30, v2 0.55, then the final evaluation of v3 (summary.json) 0.45
    h = st["heldout_reward"]
    assert (h["first"], h["last"], h["best"], h["count"]) == (
        {"weight_version": 0, "value": 0.30}, {"weight_version": 3, "value": summary["heldout_reward_end"]},
        {"weight_version": 2, "value": 0.55}, 3)
    g = st["heldout_greedy_reward"]
    assert g["best"] == {"weight_version": 3, "value": 0.75} and g["first"]["value"] == 0.5
    t = st["train_reward"]
    assert (t["first"], t["last"], t["best"]) == ({"iteration": 0, "value": 0.25}, {"iteration": 2, "value": 0.40},
                                                   {"iteration": 1, "value": 0.50})
    assert st["finished"] and st["wall_seconds"] == 12.5

    assert main(["status", "--run-id", "r1", "--artifacts", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "iterations done: 3" in text and latest["checkpoint"] in text
    assert "0.300 (weights v0) -> 0.450 (weights v3), best 0.550 (weights v2)" in text
    assert "0.250 (iteration 0) -> 0.400 (iteration 2), best 0.500 (iteration 1)" in text


def test_status_of_a_run_in_progress_uses_metrics_only(tmp_path):
    _fake_run(tmp_path, "r2", done=2, finished=False)
    st = run_status(str(tmp_path), "r2")
    assert st["iterations_done"] == 2 and not st["finished"]
    assert st["heldout_reward"]["last"] == {"weight_version": 0, "value": 0.30}  # no final evaluation yet
    assert st["train_reward"]["count"] == 2


def test_status_of_a_stale_summary_is_not_final(tmp_path):
    """summary.json of an earlier, shorter invocation (e.g. a later scheduled tick is running)."""
    _fake_run(tmp_path, "r3", done=3, finished=False)
    (tmp_path / "runs" / "r3" / "summary.json").write_text(json.dumps({"iterations": 2, "heldout_reward_end": 0.9}))
    st = run_status(str(tmp_path), "r3")
    assert not st["finished"] and st["heldout_reward"]["last"]["value"] == 0.55


def test_status_of_a_missing_run_exits_2_and_lists_the_runs(tmp_path, capsys):
    _fake_run(tmp_path, "exists", done=1, finished=False)
    assert main(["status", "--run-id", "nope", "--artifacts", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no run 'nope'" in err and "runs there: exists" in err
    assert main(["status", "--run-id", "nope", "--artifacts", str(tmp_path / "empty")]) == 2
    assert "no runs there" in capsys.readouterr().err


def test_model_info_json_matches_the_library(capsys):
    from k3core.config import K3Config
    from k3core.model.info import model_info

    assert main(["model-info", "--preset", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(model_info(K3Config.preset("tiny"))))


@pytest.mark.parametrize("argv", [["run", "--preset", "nope"], ["run", "--preset", "tiny", "--env", "no_such_module:f"],
                                  ["run", "--preset", "tiny", "--iterations", "-1"], ["prepare", "--env", "bogus"],
                                  ["model-info", "--preset", "nope"],
                                  ["checkpoint", "validate", "/nonexistent-k3rl/ckpt"]])
def test_bad_input_exits_2_before_any_work(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("k3rl") and ": error: " in first and "Traceback" not in err and len(err.strip().splitlines()) <= 2


def test_a_run_id_that_is_a_path_is_refused(tmp_path, capsys):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "latest.json").write_text("{}")
    root = tmp_path / "root"
    assert main(["status", "--run-id", "../../outside", "--artifacts", str(root)]) == 2
    assert "--run-id '../../outside'" in capsys.readouterr().err
    assert main(["run", "--run-id", "../victim", "--artifacts", str(root)]) == 2
    assert not root.exists()


def test_a_second_run_on_a_busy_run_id_is_refused(tmp_path, capsys):
    from flows.runlock import run_lock

    root = str(tmp_path)
    with run_lock(root, "busy") as held:
        assert held
        assert main(["run", "--preset", "tiny", "--run-id", "busy", "--artifacts", root]) == 2
    err = capsys.readouterr().err
    assert f"run 'busy' is busy: pid {os.getpid()}" in err and "use another --run-id" in err
    assert sorted(p.name for p in (tmp_path / "runs" / "busy").iterdir()) == [".lock"]  # nothing else was run


def test_every_bad_setting_is_listed_in_one_error(capsys):
    argv = ["run", "--preset", "nope", "--iterations", "-1", "--top-p", "2", "--run-id", "../x", "--lr", "-1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3rl: error: invalid settings (5 problems):")
    for flag in ("--preset", "--iterations", "--top-p", "--run-id", "--lr"):
        assert f"  - {flag}" in err, flag


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as e:
        main(["status", "--no-such-flag"])
    assert e.value.code == 2


def test_every_subcommand_help_shows_examples():
    p = build_parser()
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    names = ["run", "prepare", "model-info", "status", "plan", "checkpoint", "serve", "deploy", "worker"]
    for name in names:
        assert "example" in (sub.choices[name].format_help()), name
    cp = next(a for a in sub.choices["checkpoint"]._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in ("init", "fetch", "validate", "quantize"):
        assert "example" in cp.choices[name].format_help(), name
    assert "exit status 0 valid, 1 invalid" in cp.choices["validate"].format_help()  # kept above the examples
    assert "exit status" in p.format_help()


def test_lineage_and_checkpoint_markdown(tmp_path):
    run = _fake_run(tmp_path, "r4", done=2, finished=False)
    s, prep, lineage = run["settings"], run["prep"], run["lineage"]
    md = reports.lineage_markdown(s, lineage)
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    assert len(rows) == len(lineage) == len(prep) + 2  # source, validation report, warm-up, MXFP4 weights, then the run's
    assert f"`file://{tmp_path}/runs/r4`" in md  # the run directory, named once
    assert rows[0] == f"| `source` | source checkpoint | `{'a' * 12}` | fetch_checkpoint | `init:tiny:0` |"
    assert rows[1].startswith("| `source.validation.json` | validation report | - |")
    ck2 = lineage[-1]
    assert rows[2] == f"| `warmup` | warmed-up policy | `{'b' * 12}` | warmup | `source` |"
    assert f"| `checkpoints/iter-0002` | checkpoint | `{ck2.sha256[:12]}` | save_checkpoint-iter1 | `iter-0001/trainer` |" in rows
    cmd = reports.checkpoints_markdown(s, lineage)
    assert f"**latest checkpoint** (after 2 iterations): `{ck2.uri}`" in cmd
    assert f"| 2 | `checkpoints/iter-0002` | `{ck2.sha256[:12]}` | save_checkpoint-iter1 |" in cmd
    assert "](" not in cmd  # file:// URIs are shown as text: the UI would strip such links
    assert "deleted" not in cmd
    # a checkpoint retention deleted stays in the table, marked
    from k3core.artifacts import ArtifactStore

    assert ArtifactStore(str(tmp_path)).remove("runs/r4/checkpoints/iter-0001")
    cmd = reports.checkpoints_markdown(s, lineage)
    assert "| 1 | `checkpoints/iter-0001` (deleted: --keep-checkpoints) |" in cmd
    assert f"| 2 | `checkpoints/iter-0002` | `{ck2.sha256[:12]}` |" in cmd
    # run by Prefect: *produced by* links to the task run's page, as the lineage table does
    import dataclasses

    ran = [*lineage[:-1], dataclasses.replace(ck2, produced_by_id="0b7e-task-run")]
    cmd = reports.checkpoints_markdown(s, ran)
    assert f"| `{ck2.sha256[:12]}` | [save_checkpoint-iter1](/runs/task-run/0b7e-task-run) |" in cmd


def test_http_uris_become_links():
    assert reports._link_or_code("https://h/x", "x") == "[x](https://h/x)"
    assert reports._link_or_code("s3://b/k") == "`s3://b/k`"


def test_report_keys_are_per_run():
    """Prefect artifact keys are global: each run's reports carry its id (keys allow [a-z0-9-] only)."""
    assert reports.artifact_key("metrics", "demo") == "rl-metrics-demo"
    assert reports.artifact_key("lineage", "Run_1.b").startswith("rl-lineage-run-1-b-")
    assert reports.artifact_key("metrics", "a") != reports.artifact_key("metrics", "b")
    # one-to-one: ids that read the same once lowercased and dashed keep keys of their own
    ids = ["exp-1", "Exp.1", "exp.1", "EXP-1", "exp_1"]
    keys = [reports.artifact_key("metrics", i) for i in ids]
    assert len(set(keys)) == len(ids) and all(re.fullmatch(r"[a-z0-9-]+", k) for k in keys), keys
    assert reports.artifact_key("metrics", "Exp.1") == reports.artifact_key("metrics", "Exp.1")


def test_table_numbers_keep_four_significant_digits_and_small_ones_readable():
    from flows.reports import table_number

    assert table_number(0.452123456) == "0.4521"
    assert table_number(2.3456e-06) == "2.346e-06"  # rounding to 5 decimals made this 0.0
    assert table_number(-0.00012346) == "-1.235e-04"
    assert table_number(1234.5678) == "1235"
    assert table_number(12.0) == "12"
    assert table_number(0.0) == "0" and table_number(float("nan")) == "nan"
    assert table_number(3) == 3 and table_number(True) is True and table_number("") == ""
    assert float(table_number(0.001)) == 0.001 and table_number(0.001) == "0.001"


def test_summary_sums_stages_and_keeps_the_iteration_wall_time_apart(tmp_path):
    s = RLSettings.from_dict(dict(preset="tiny", artifacts=str(tmp_path), run_id="sum"))
    history = [{"seconds_rollout": 1.0, "seconds_train": 2.0, "seconds_iteration": 3.5, "reward_mean": 0.1},
               {"seconds_rollout": 1.5, "seconds_train": 2.5, "seconds_iteration": 4.5, "reward_mean": 0.2}]
    out = reports.summary(s, {"fetch": 0.25}, history, {"heldout_reward": 0.5, "heldout_solved": 0.0}, 10.0)
    assert out["seconds_per_stage"] == {"rollout": 2.5, "train": 4.5, "prepare_fetch": 0.2}
    assert out["iteration_seconds"] == 8.0


def test_status_without_a_run_id_shows_the_newest_run_and_an_empty_root_is_exit_2(tmp_path, capsys):
    """Run ids are generated when not given, so ``status`` alone picks the run whose directory changed
    last (by its modification time, set here), and says which on stderr."""
    import os

    for i, run_id in enumerate(["zeta", "alpha"]):  # sorted order and age disagree: age must decide
        d = tmp_path / "runs" / run_id
        d.mkdir(parents=True)
        os.utime(d, (1_000_000 + i * 100, 1_000_000 + i * 100))
    from flows.status import newest_run

    assert newest_run(str(tmp_path)) == "alpha"
    assert main(["status", "--artifacts", str(tmp_path / "empty")]) == 2
    assert "no runs under" in capsys.readouterr().err


def test_the_program_ends_without_teardown_and_keeps_its_output_and_status():
    """``python -m flows.cli`` (``flows.cli.entry``) ends with ``os._exit`` after its exit handlers:
    its buffered output to a pipe still arrives whole, equal to ``main``'s in process, with the
    status ``main`` returned (0 here, 2 for bad input), and an exit handler registered during the
    command still runs."""
    import contextlib
    import io
    import os
    import subprocess
    import sys
    from pathlib import Path

    from flows.cli import main

    root = Path(__file__).resolve().parents[2]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["model-info", "--preset", "full", "--json"]) == 0
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output to a pipe stays in buffers
    done = subprocess.run([sys.executable, "-m", "flows.cli", "model-info", "--preset", "full", "--json"], cwd=root,
                          env=buffered, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, buf.getvalue()), done.stderr
    # an exit handler registered while the command runs (as Prefect's and the embedded server's are)
    handler = ("import atexit, sys, flows.cli as c; run = c.main\n"
               "def main():\n    atexit.register(lambda: print('handler ran', file=sys.stderr))\n    return run()\n"
               "c.main = main; sys.argv = ['k3rl', 'model-info', '--preset', 'nope']; sys.exit(c.entry())")
    bad = subprocess.run([sys.executable, "-c", handler], cwd=root, env=buffered, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "handler ran" in bad.stderr, bad.stderr
