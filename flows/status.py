"""``k3rl status``: a run summarised from its artifacts alone (no Prefect server, no torch).

Reads, under ``<artifacts>/runs/<run_id>/``:
  ``latest.json``    the last published checkpoint (iteration, weight version, URI): iterations done;
  ``metrics.json``   one metrics dict per iteration (train reward, held-out evaluations);
  ``summary.json``   the end-of-run report, with the final held-out evaluation (used only when it
                     describes the same number of iterations as ``latest.json``);
  ``settings.json``  the recorded settings of a scheduled run (``rl_continue``), when present.

Held-out reward is reported per *weight version*: an evaluation in iteration N scores the weights
before that iteration's update (version N); the final evaluation scores version ``iterations_done``.
"""

from __future__ import annotations


__all__ = ["RunNotFound", "format_status", "list_runs", "newest_run", "run_status"]


class RunNotFound(ValueError):
    """No artifacts of that run under that root (bad input: exit status 2)."""


def list_runs(artifacts: str) -> list[str]:
    """Run ids with a directory under ``<artifacts>/runs`` (empty when there is none)."""
    from k3core.artifacts import ArtifactStore
    from k3core.rl.layout import RUNS

    store = ArtifactStore(artifacts)
    try:
        entries = store.fs.ls(f"{store.base}/{RUNS}", detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")


def newest_run(artifacts: str) -> str:
    """The run whose directory changed last (ties, or a store without modification times: the last
    id in sorted order); ``RunNotFound`` when the root holds no run."""
    from k3core.artifacts import ArtifactStore
    from k3core.rl.layout import RunLayout

    runs = list_runs(artifacts)
    if not runs:
        raise RunNotFound(f"no runs under {artifacts}: start one with `k3rl run`, or point --artifacts at the "
                          "root your runs were written to")
    store = ArtifactStore(artifacts)

    def changed(run_id: str) -> float:
        info = store.fs.info(f"{store.base}/{RunLayout(run_id).rel()}")
        t = info.get("mtime") or info.get("LastModified") or 0
        return t.timestamp() if hasattr(t, "timestamp") else float(t)

    return max(runs, key=lambda r: (changed(r), r))


def _read_json(store, rel: str):
    from k3core.rl.layout import parse_record

    return parse_record(store.read_text(rel), store.uri(rel)) if store.exists(rel) else None


def _trend(points: list[tuple[int, float]], key: str) -> dict | None:
    """first / last / best of ``(position, value)`` points; ties for best go to the earliest."""
    if not points:
        return None
    pick = [{key: p, "value": v} for p, v in points]
    best = max(range(len(points)), key=lambda i: (points[i][1], -i))
    return {"first": pick[0], "last": pick[-1], "best": pick[best], "count": len(points)}


def run_status(artifacts: str, run_id: str) -> dict:
    """The summary of run ``run_id`` (JSON-able). Raises ``RunNotFound`` when nothing of it exists."""
    from k3core.artifacts import ArtifactStore
    from k3core.rl.layout import RunLayout
    from k3core.settings import PipelineSettings

    PipelineSettings(run_id=run_id)  # a run id that is a path (``../..``) is refused: SettingsError, exit status 2
    store, layout = ArtifactStore(artifacts), RunLayout(run_id)
    latest = _read_json(store, layout.latest)
    history = _read_json(store, layout.metrics) or []
    settings = _read_json(store, layout.settings)
    started = latest is not None or history or settings is not None or store.exists(layout.validation)
    if not started:
        runs = list_runs(artifacts)
        raise RunNotFound(f"no run '{run_id}' under {store.uri('').rstrip('/')} (no {layout.latest}); "
                          + (f"runs there: {', '.join(runs)}" if runs else "no runs there"))
    done = int(latest["iteration"]) if latest else 0
    summary = _read_json(store, layout.summary)
    final = summary if summary and summary.get("iterations") == done and done > 0 else None

    def heldout(metric: str, final_key: str) -> dict | None:
        pts = [(int(h.get("weight_version", h["iteration"])), float(h[metric])) for h in history if metric in h]
        if final and final.get(final_key) is not None and (not pts or pts[-1][0] < done):
            pts.append((done, float(final[final_key])))
        return _trend(pts, "weight_version")

    return {
        "run_id": run_id,
        "artifacts": store.uri("").rstrip("/"),
        "iterations_done": done,
        "iterations_with_metrics": len(history),
        "weight_version": int(latest["version"]) if latest else 0,
        "latest_checkpoint": latest["checkpoint"] if latest else None,
        "heldout_reward": heldout("heldout_reward", "heldout_reward_end"),
        "heldout_greedy_reward": heldout("heldout_greedy_reward", "heldout_greedy_reward_end"),
        "train_reward": _trend([(int(h["iteration"]), float(h["reward_mean"])) for h in history], "iteration"),
        "finished": final is not None,
        "wall_seconds": final.get("wall_seconds") if final else None,
        "settings": settings,
    }


def _fmt_trend(t: dict | None, key: str, where) -> str:
    if t is None:
        return "n/a"
    f, l, b = t["first"], t["last"], t["best"]
    return (f"{f['value']:.3f} ({where(f[key])}) -> {l['value']:.3f} ({where(l[key])}), "
            f"best {b['value']:.3f} ({where(b[key])}); {t['count']} points")


def format_status(st: dict) -> str:
    def weights(v):
        return f"weights v{v}"

    def iteration(n):
        return f"iteration {n}"

    lines = [f"run '{st['run_id']}' under {st['artifacts']}",
             f"  iterations done: {st['iterations_done']} (engine weights v{st['weight_version']})"
             + ("" if st["finished"] else "; no end-of-run report for this many iterations yet"),
             f"  latest checkpoint: {st['latest_checkpoint'] or 'none yet'}",
             f"  held-out reward, sampled: {_fmt_trend(st['heldout_reward'], 'weight_version', weights)}",
             f"  held-out reward, greedy: {_fmt_trend(st['heldout_greedy_reward'], 'weight_version', weights)}",
             f"  train reward (sampled): {_fmt_trend(st['train_reward'], 'iteration', iteration)}"]
    if st["settings"]:
        s = st["settings"]
        flat = {k: v for sec in s.values() if isinstance(sec, dict) for k, v in sec.items()} | s  # nested or flat
        lines.append("  settings: " + ", ".join(f"{k} {flat[k]}" for k in ("preset", "env", "source") if k in flat))
    return "\n".join(lines)
