"""``--in-flight continue|abort`` end to end on the tiny preset in Prefect's embedded mode: under
``--max-staleness 1`` the weight update after train step N reaches the batch of N+1 while it is
still generating (the test holds that batch's rollout after its third decode step until the update
begins, so the overlap does not depend on the machine's speed). The batch's tokens carry the
versions that sampled them (``continue``: a row's old tokens then its new ones; ``abort``: each row
one version's), the iteration's metrics count the newer tokens, and its version is the oldest."""

import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flows.pipeline import RLSettings, rl_run
from k3core.rl import engines, trainers
from k3core.rollout.engine import RolloutEngine
from k3core.settings import SettingsError

# the even-bytes environment of tests/even_bytes_env.py (crash injection included), under this test file's
# own module name
ENV_SRC = (Path(__file__).resolve().parents[1] / "even_bytes_env.py").read_text()


def _hold_rollouts_ahead_until_the_update(monkeypatch, on_rollout=lambda n: None) -> list[int]:
    """Every rollout but the first (the flow's own thread samples batch 0; the batches sampled ahead
    run on the task runner's threads) waits after its third decode step until a weight update begins.
    Returns the list the rollouts append to (``on_rollout(how many so far)`` runs as each starts)."""
    import k3core.rl.tables as tables

    local, flow_thread = threading.local(), []
    real_table, real_step = tables.rollout_table, RolloutEngine.step

    def rollout_table(*a, **k):
        flow_thread.append(flow_thread[0] if flow_thread else threading.get_ident())
        on_rollout(len(flow_thread))
        local.gate = {"steps": 0, "version": None} if threading.get_ident() != flow_thread[0] else None
        try:
            return real_table(*a, **k)
        finally:
            local.gate = None

    def step(self):
        gate = getattr(local, "gate", None)
        if gate is not None:
            gate["version"] = self.weight_version if gate["version"] is None else gate["version"]
            gate["steps"] += 1
            deadline = time.monotonic() + 60
            while (gate["steps"] == 3 and self.weight_version == gate["version"] and not self._swapping
                   and time.monotonic() < deadline):
                time.sleep(0.01)
        return real_step(self)

    monkeypatch.setattr(tables, "rollout_table", rollout_table)
    monkeypatch.setattr(RolloutEngine, "step", step)
    return flow_thread


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", ["continue", "abort"])
def test_the_weight_update_reaches_the_batch_sampled_ahead(tmp_path: Path, monkeypatch, prefect_harness, in_flight):
    engines.clear()
    trainers.clear()
    _hold_rollouts_ahead_until_the_update(monkeypatch)
    s = RLSettings.from_dict(dict(preset="tiny", source="init:tiny:3", iterations=3, artifacts=str(tmp_path),
                                  run_id="inflight", prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=12,
                                  warmup_steps=0, eval_prompts=4, eval_every=0, lr=1e-3, max_staleness=1,
                                  in_flight=in_flight))
    summary = rl_run(s)
    history = json.loads((tmp_path / "runs" / "inflight" / "metrics.json").read_text())
    assert summary["iterations"] == 3
    assert history[0]["weight_version"] == 0 and history[0]["newer_tokens"] == 0
    for n in (1, 2):
        table = pq.read_table(tmp_path / "runs" / "inflight" / f"iter-{n:04d}" / "rollouts.parquet").to_pylist()
        versions = [r["token_versions"] for r in table]
        assert all(v == sorted(v) and set(v) <= {n - 1, n} for v in versions)
        oldest = min(x for v in versions for x in v)
        assert history[n]["weight_version"] == oldest and history[n]["staleness"] == n - oldest
        assert history[n]["newer_tokens"] == sum(x > oldest for v in versions for x in v)
        histogram = {k: m for k, m in history[n].items() if k.startswith("tokens_staleness_")}
        assert histogram == {f"tokens_staleness_{n - u}": sum(x == u for v in versions for x in v)
                             for u in {x for v in versions for x in v}}
        assert any(n in v for v in versions)
        if in_flight == "continue":  # rows the update reached mid-generation: old tokens, then new ones
            assert oldest == n - 1 and any(len(set(v)) == 2 for v in versions), versions
        else:  # aborted rows were sampled again whole
            assert all(len(set(v)) == 1 for v in versions), versions
        assert all(r["weight_version"] == r["token_versions"][0] for r in table if r["token_versions"])
    assert [m["buffer_depth"] for m in history] == [1, 1, 0]  # batches sampled ahead, not yet trained on
    stats = engines.get("inflight").stats
    assert stats["updates_in_flight"] == 2 and (stats["aborted"] > 0) == (in_flight == "abort")

@pytest.mark.slow
def test_a_crash_after_the_batch_reached_in_flight_resumes_on_it(tmp_path: Path, monkeypatch, prefect_harness):
    """The scorer of iteration 2 crashes: its batch, sampled ahead during iteration 1 and reached by
    the update there, is published. The resumed run (a new "process") trains on that very table,
    never samples it again, and records its newer tokens."""
    (tmp_path / "flaky_even_for_tests.py").write_text(ENV_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "crash-now"
    monkeypatch.setenv("K3RL_TEST_CRASH_FILE", str(marker))
    rollouts = _hold_rollouts_ahead_until_the_update(monkeypatch, lambda n: n == 3 and marker.write_text("crash"))
    s = RLSettings.from_dict(dict(preset="tiny", source="init:tiny:3", env="flaky_even_for_tests:make", iterations=3,
                                  artifacts=str(tmp_path), run_id="crash", prompts_per_iteration=4,
                                  samples_per_prompt=4, max_new_tokens=12, warmup_steps=0, eval_prompts=4,
                                  eval_every=0, max_staleness=1, in_flight="continue"))
    engines.clear()
    trainers.clear()
    with pytest.raises(Exception, match="injected scorer crash"):
        rl_run(s)
    run = tmp_path / "runs" / "crash"
    ahead = run / "iter-0002" / "rollouts.parquet"
    assert len(rollouts) == 3 and not (run / "iter-0002" / "scored.parquet").exists()
    before, table = ahead.stat().st_mtime_ns, pq.read_table(ahead)
    versions = table.column("token_versions").to_pylist()
    assert any(len(set(v)) == 2 for v in versions)  # the update reached it mid-generation

    marker.unlink()
    engines.clear()
    trainers.clear()
    rl_run(s)
    assert len(rollouts) == 3, "the batch sampled ahead was sampled again"
    assert ahead.stat().st_mtime_ns == before and pq.read_table(ahead).equals(table)
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics) == 3 and metrics[2]["weight_version"] == 1
    assert metrics[2]["newer_tokens"] == sum(x > 1 for v in versions for x in v) > 0


def test_in_flight_needs_a_batch_sampled_ahead_and_the_embedded_engine():
    with pytest.raises(SettingsError, match="--in-flight continue acts on the batch sampled ahead"):
        RLSettings.from_dict({"in_flight": "continue"})
    with pytest.raises(SettingsError, match="--rollout-url http://127.0.0.1:1"):
        RLSettings.from_dict({"in_flight": "abort", "max_staleness": 1, "rollout_url": "http://127.0.0.1:1"})
    with pytest.raises(SettingsError, match="--in-flight: unknown choice 'finish'"):
        RLSettings.from_dict({"in_flight": "finish", "max_staleness": 1})
