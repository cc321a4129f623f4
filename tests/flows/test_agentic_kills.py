"""Kill -9 inside an agentic run (``--env tools-calc``: multi-turn episodes of calculator calls on the
bundled BPE): the episodes' rollout killed with its table half written, the scorer killed after it
published, each resumed by the same command, end equal to an uninterrupted run of it. The command,
helpers and comparison are ``test_kill_matrix.py``'s (its flags, with the agentic ones after them);
docs/reliability.md, "Kill -9 at every stage". Episodes are seeded per (prompt position, sample,
turn), so the episodes a resume samples again are the ones the killed process sampled, token for
token, whatever the order their turns were batched in. Their log-probabilities are not bitwise
the killed process's: a turn joins the engine's running batch when its tools return, so the batch
it is computed in differs, and a CPU matmul's rounding depends on it (last-ulp differences seen).
Ids, masks, turns, rewards and the data cursor must be equal; every float within float32 rounding
carried through two updates."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

AGENTIC = ("--source", "init:tiny:0:bpe", "--env", "tools-calc", "--max-new-tokens", "24", "--max-turns", "2",
           "--max-episode-tokens", "64")
KILLS = ["rollout-iter1:mid-write", "score_rewards-iter1:after-publish"]


@pytest.fixture(scope="module")
def agentic_baseline(tmp_path_factory, prefect_server, kill_matrix):
    km, base = kill_matrix, tmp_path_factory.mktemp("agentic-baseline")
    done, _ = km._k3rl(base / "artifacts", base / "prefect-home", None, prefect_server.api, extra=AGENTIC)
    assert done.returncode == 0, done.stdout[-3000:]
    return km._final_state(base / "artifacts")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_agentic_run_killed_in_its_episodes_and_its_scorer_resumes_equal(agentic_baseline, tmp_path, prefect_server,
                                                                           kill_matrix):
    km = kill_matrix
    artifacts, home = tmp_path / "artifacts", tmp_path / "prefect-home"
    run = artifacts / "runs" / km.RUN_ID
    killed_pid = None
    for fault in [*KILLS, None]:
        published = km._published(run) if run.exists() else {}
        done, pid = km._k3rl(artifacts, home, fault, prefect_server.api, extra=AGENTIC)
        log = done.stdout[-4000:]
        if killed_pid is not None:
            assert f"from pid {killed_pid}, which died holding it" in done.stdout, f"{fault}: no lock takeover\n{log}"
        changed = {k for k, v in published.items() if km._published(run).get(k) != v}
        assert not changed, f"{fault}: published artifacts were written again: {sorted(changed)}"
        if fault is None:
            assert done.returncode == 0, log
            break
        assert done.returncode == -9, f"{fault}: expected SIGKILL at the fault point, got {done.returncode}\n{log}"
        killed_pid = pid
    assert km._staging(run) == []
    final = km._final_state(artifacts)
    assert "turns" in final["tables"]["iter-0001/rollouts.parquet"].column_names  # the episodes' table
    assert final["iteration"] == agentic_baseline["iteration"] == 2
    _assert_close(km._drop_timings(final), km._drop_timings(agentic_baseline))


def _floats(x) -> bool:
    return pa.types.is_floating(x) or (pa.types.is_list(x) and pa.types.is_floating(x.value_type))


def _assert_close(a, b, where: str = "") -> None:
    """``test_kill_matrix._assert_same`` with floats compared within float32 rounding carried through
    the run (relative 1e-4), everything else exactly."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _assert_close(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, pa.Table):
        assert a.schema.equals(b.schema) and a.num_rows == b.num_rows, where
        for name in a.column_names:
            x, y = a[name].to_pylist(), b[name].to_pylist()
            if _floats(a.schema.field(name).type):
                _assert_close(x, y, f"{where}/{name}")
            else:
                assert x == y, f"{where}/{name}"
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (where, a, b)
    else:
        assert a == b, where
