"""What a run shows in the Prefect UI (the open-source UI has no asset graph, so lineage is shown
through artifacts), published by the ``rl_run`` flow after every iteration:

- ``rl-metrics-<run id>`` (table): one row per RL iteration;
- ``rl-lineage-<run id>`` (markdown): every artifact of the run (relative to the artifact root, which it names
  once), its kind, content hash, the task run that produced it and its inputs;
- ``rl-curves-<run id>`` (markdown): the reward and KL curves as a PNG inside the markdown, as a
  ``data:image/png;base64`` URI: both Prefect UIs allow exactly this image source (the v2 UI's
  markdown sanitizer admits ``data:image/`` for ``img`` and http(s) otherwise; the v1 UI renders it
  too), while a ``file://`` path would never load in a browser and an http URL would need a server
  of our own; tests/flows/test_ui_browser.py checks that the image decodes in Chromium;
- ``rl-checkpoints-<run id>`` (markdown): the latest checkpoint, every iteration's checkpoint with its
  manifest hash, and the validation report (http(s) URIs as links; ``file://`` and ``s3://`` as text,
  since the UI strips links it cannot open), with the commands that read them;
- ``rl-progress-<run id>`` (progress): iterations done out of those asked for.

Each report is created once per flow run and updated in place after every iteration, so the flow
run's Artifacts tab shows one card per report with the run's current state (a continued run, one
more flow run, adds one version of each key).

Also writes the curves as PNG files and the history as ``metrics.json`` beside the run's artifacts,
and ``summary.json`` at the end (``summary``)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import re
import statistics
from typing import TYPE_CHECKING

from prefect.artifacts import (
    create_markdown_artifact,
    TableArtifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext

from k3core.artifacts import Artifact, ArtifactStore, inner_path
from k3core.rl.layout import RunLayout, RunRecordError, parse_record
from k3core.settings import RLSettings

if TYPE_CHECKING:
    from tasks.common import Batch

TABLE_COLUMNS = ["iteration", "weight_version", "staleness", "reward_mean", "reward_std", "solved_fraction", "heldout_reward",
                 "heldout_greedy_reward", "kl_rollout_trainer_k3", "clip_fraction", "approx_kl", "kl_ref", "ratio_std",
                 "groups_dropped", "sampling_rounds", "entropy", "grad_norm", "response_length_mean", "tis_weight_mean",
                 "train_tokens_per_s", "seconds_rollout", "seconds_train", "transfer_seconds"]
# Columns of agentic runs only (tool use per episode, ``k3core.rl.episodes.episode_stats``).
EPISODE_COLUMNS = ["episode_turns", "tool_calls_per_episode", "tool_error_rate", "episode_tokens", "answered_fraction"]
# The progress artifact of each flow run (created on its first publication, then updated).
_progress_ids: dict = {}
# The report artifacts of each flow run, by kind (created once, then updated).
_report_ids: dict = {}


def table_number(x):
    """A metric as the UI table shows it: 4 significant digits, scientific notation below 1e-3 (a KL
    of 2.3e-06 is not "0.0"), integers and text unchanged, NaN/inf spelled out."""
    if isinstance(x, bool) or not isinstance(x, float):
        return x
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if x == 0.0:
        return "0"
    return f"{x:.3e}" if abs(x) < 1e-3 or abs(x) >= 1e6 else f"{x:.4g}"


def artifact_key(kind: str, run_id: str) -> str:
    """The Prefect artifact key of one of a run's reports, ``rl-<kind>-<run id>``: keys are global in
    Prefect, so without the run id one run's reports would supersede another's. Keys allow lowercase
    letters, digits and dashes only: a run id made of those is the key's tail as it is; any other has
    its other characters as dashes and 8 hex digits of its sha256 after them, so two run ids never
    share a key (``Exp.1`` and ``exp-1`` would both read ``exp-1``)."""
    tail = re.sub(r"[^a-z0-9-]", "-", run_id.lower())
    if tail != run_id:
        tail += "-" + hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"rl-{kind}-{tail}"


def _files(s: RLSettings) -> tuple[ArtifactStore, RunLayout]:
    """The run's artifact store and its layout under it."""
    return ArtifactStore(s.pipeline.artifacts), RunLayout(s.pipeline.run_id)


def _in_flow() -> bool:
    return FlowRunContext.get() is not None


def curves_png(history: list[dict]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [h["iteration"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90)
    a.plot(it, [h["reward_mean"] for h in history], label="train reward (sampled)")
    ev = [(h["iteration"], h["heldout_reward"]) for h in history if "heldout_reward" in h]
    if ev:
        a.plot(*zip(*ev), "o-", label="held-out reward (sampled)")
        a.plot(*zip(*[(h["iteration"], h["heldout_greedy_reward"]) for h in history if "heldout_greedy_reward" in h]),
               "s--", label="held-out reward (greedy)")
    a.set_xlabel("iteration"), a.set_ylim(0, 1), a.legend(fontsize=8), a.set_title("reward")
    b.plot(it, [h.get("kl_rollout_trainer_k3", 0.0) for h in history], color="C3")
    b.set_xlabel("iteration"), b.set_title("KL(rollout || trainer), k3")
    for ax in (a, b):
        ax.xaxis.get_major_locator().set_params(integer=True)  # iterations are whole numbers
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _rel(uri: str, root_uri: str) -> str:
    """``uri`` relative to the artifact root when it lies under it (shorter table cells)."""
    return uri[len(root_uri) + 1:] if uri.startswith(root_uri + "/") else uri


def _link_or_code(uri: str, text: str | None = None) -> str:
    """A markdown link for a URL a browser can open; otherwise the URI as code (the UI's sanitizer
    drops ``file://``/``s3://`` links, and a browser would not open them from an http page)."""
    if uri.startswith(("http://", "https://")):
        return f"[{text or uri}]({uri})"
    return f"`{uri}`"


def _label(a: Artifact) -> str:
    """What an artifact is, for the lineage table."""
    if a.kind == "dcp":
        if "manifest" in a.info:
            return "checkpoint"
        return "trainer state (QAT: MXFP4 routed experts)" if a.info.get("qat") else "trainer state"
    return {"hf": "warmed-up policy" if a.produced_by == "warmup" else "source checkpoint",
            "hf-mxfp4": f"rollout weights v{a.version} (MXFP4)", "report": "validation report",
            "rollouts": "rollouts", "scored": "scored", "engine": f"engine weights v{a.version}"}.get(a.kind, a.kind)


def _ui_base() -> str:
    """The Prefect UI's address for links ("" in embedded mode: links are then relative to the page,
    which the UI serves from its root)."""
    try:
        from prefect.settings import get_current_settings

        return (get_current_settings().ui_url or "").rstrip("/")
    except Exception:  # no settings context: relative links still work inside the UI
        return ""


def task_run_link(a: Artifact, text: str | None = None, ui: str = "") -> str:
    """The artifact's producing task run as a link to its page in the UI, or its name when no
    orchestrator ran it."""
    name = text or a.produced_by or "-"
    return f"[{name}]({ui}/runs/task-run/{a.produced_by_id})" if a.produced_by_id else name


def tick_markdown(run_id: str, summary: dict) -> str:
    """The note a scheduled tick (``rl_continue``) leaves on its own flow run: where the run stands and
    links to the run's reports, which sit on the ``rl_run`` subflow it called."""
    ui = _ui_base()
    kinds = ("metrics", "lineage", "curves", "checkpoints", "progress")
    links = " | ".join(f"[rl-{k}]({ui}/artifacts/key/{artifact_key(k, run_id)})" for k in kinds)
    held = summary.get("heldout_reward_end")
    return (f"### run `{run_id}`: {summary.get('iterations', '?')} iterations done\n\n"
            + (f"- held-out reward at the end: {table_number(held)}\n" if isinstance(held, float) else "")
            + f"- the run's reports: {links}\n")


def lineage_markdown(s: RLSettings, lineage: list[Artifact]) -> str:
    """The ``rl-lineage`` table: one row per artifact, oldest first. *produced by* links to the task
    run that published the artifact, each input to the task run that published that input."""
    store, layout = _files(s)
    run_uri = store.uri(layout.rel())
    md = [f"### run `{s.pipeline.run_id}`: where every artifact came from", "",
          f"Paths are relative to the run's directory `{run_uri}`; sha256 is the content hash (a directory's "
          "over its sorted files). *produced by* links to the task run (stage and iteration); each input "
          "links to the task run that produced it.", "",
          "| artifact | kind | sha256 | produced by | inputs |", "|---|---|---|---|---|"]
    ui = _ui_base()
    by_uri = {a.uri: a for a in lineage}
    for a in lineage:
        inputs = a.inputs or ((a.info["source"],) if "source" in a.info else ())
        ins = "<br>".join(task_run_link(by_uri[i], _rel(i, run_uri), ui) if i in by_uri and by_uri[i].produced_by_id
                          else f"`{_rel(i, run_uri)}`" for i in inputs)
        sha = "" if a.kind == "report" else a.sha256
        md.append(f"| `{_rel(a.uri, run_uri)}` | {_label(a)} | {f'`{sha[:12]}`' if sha else '-'} | "
                  f"{task_run_link(a, ui=ui)} | {ins} |")
    return "\n".join(md)


def checkpoints_markdown(s: RLSettings, lineage: list[Artifact]) -> str:
    """The ``rl-checkpoints`` note: latest checkpoint, every iteration's checkpoint (*produced by*
    links to the task run that saved it), validation report."""
    store, layout = _files(s)
    run_id = s.pipeline.run_id
    root_uri, run_uri = store.uri("").rstrip("/"), store.uri(layout.rel())
    cks = [a for a in lineage if a.kind == "dcp" and "manifest" in a.info]
    report = next((a for a in lineage if a.kind == "report"), None)
    ui = _ui_base()
    md = [f"### run `{run_id}`: checkpoints and reports", ""]
    if cks:
        md.append(f"- **latest checkpoint** (after {len(cks)} iterations): {_link_or_code(cks[-1].uri)}")
    if report is not None:
        md.append(f"- **validation report** of the source checkpoint: {_link_or_code(report.uri)}")
    md.append(f"- **summary of the run**: `k3rl status --run-id {run_id} --artifacts {root_uri}`")
    if cks:
        md += ["", f"Every checkpoint (paths relative to the run's directory `{run_uri}`):", "",
               "| after iteration | checkpoint | manifest sha256 | produced by |", "|---|---|---|---|"]
        for a in cks:
            rel = _rel(a.uri, run_uri)
            cell = _link_or_code(a.uri, rel) if a.uri.startswith('http') else f'`{rel}`'
            if not store.exists(layout.rel(rel)):
                cell += " (deleted: --keep-checkpoints)"
            md.append(f"| {a.version} | {cell} | `{a.sha256[:12]}` | {task_run_link(a, ui=ui)} |")
    return "\n".join(md)


def iteration_metrics(iteration: int, batch: Batch, trained: Artifact, engine: Artifact, heldout: dict,
                      mismatch: dict, seconds: dict[str, float]) -> dict:
    """One row of the run's history: what the iteration's stages measured. The reward statistics and
    the tokens are the first sampling round's; ``weight_version`` is the version its rollouts were
    sampled with (``staleness`` behind the policy's, ``iteration``), ``newer_tokens`` how many of
    its tokens a later version sampled (a weight update in flight, ``--in-flight``), and
    ``tokens_staleness_S`` the staleness histogram: the batch's sampled tokens S versions behind."""
    rollouts, scored = batch.rollouts[0], batch.scored[0]
    histogram = {f"tokens_staleness_{iteration - v}": n for v, n in rollouts.info.get("tokens_by_version", [])}
    return {**histogram,"iteration": iteration, "weight_version": rollouts.version, "qat": trained.info["qat"], **scored.info,
            **{k: v for k, v in trained.info["metrics"].items() if isinstance(v, (int, float))},
            "rollout_tokens": rollouts.info["tokens"], "newer_tokens": rollouts.info.get("newer_tokens", 0),
            "transfer_seconds": engine.info["seconds"],
            **{k: v for k, v in heldout.items() if k.startswith("heldout")}, **mismatch,
            **{f"seconds_{k}": v for k, v in seconds.items()},
            "sampling_rounds": batch.rounds, "policy_version": iteration, "staleness": iteration - rollouts.version}


def progress_line(n: int, total: int, m: dict, seconds_left: float | None = None) -> str:
    """The log line of iteration ``n``: training reward, the held-out rewards when evaluated, and the
    time left at the pace so far (``seconds_left``)."""
    held = (f" held-out {m['heldout_reward']:.3f} (greedy {m['heldout_greedy_reward']:.3f})"
            if "heldout_greedy_reward" in m else f" held-out {m['heldout_reward']:.3f}" if "heldout_reward" in m else "")
    left = f", about {_duration(seconds_left)} left" if seconds_left is not None and n + 1 < total else ""
    return (f"[{n + 1}/{total}] reward {m['reward_mean']:.3f} solved {m['solved_fraction']:.2f} "
            f"KL(rollout||trainer) {m.get('kl_rollout_trainer_k3', 0):.4f}{held}{left}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def record_lineage(s: RLSettings, prepared: list[Artifact], iterations: list[list[Artifact]]) -> None:
    """``lineage.json`` beside ``metrics.json``: the artifacts of prepare and of each finished
    iteration (what ``finished_iterations`` reads back to continue a run without replaying it)."""
    doc = {"prepare": [a.to_dict() for a in prepared], "iterations": [[a.to_dict() for a in it] for it in iterations]}
    store, layout = _files(s)
    store.replace_text(layout.lineage, json.dumps(doc, indent=1))


def read_record(store: ArtifactStore, rel: str):
    """A run record's JSON (``k3core.rl.layout.parse_record``: ``RunRecordError`` names the file)."""
    return parse_record(store.read_text(rel), store.uri(rel))


def finished_iterations(s: RLSettings) -> tuple[list[dict], list[list[Artifact]]]:
    """(metrics, artifacts) of the iterations this run has finished and recorded, at most
    ``iterations`` of them; empty when there are none or the records disagree with the checkpoints
    (then the run starts at iteration 0, and its cached stages find their published work)."""
    store, layout = _files(s)
    if not (store.exists(layout.metrics) and store.exists(layout.lineage)):
        return [], []
    history = read_record(store, layout.metrics)
    recorded = read_record(store, layout.lineage)
    try:
        lineage = [[Artifact.from_dict(a) for a in it] for it in recorded["iterations"]]
        if not all(isinstance(h, dict) for h in history):
            raise TypeError("a metrics row is not an object")
    except (KeyError, TypeError, AttributeError) as e:
        raise RunRecordError(f"{store.uri(layout.lineage)} or {store.uri(layout.metrics)} is not a k3rl run record "
                             f"({type(e).__name__}: {e}); restore them from a copy, or delete both to have the run "
                             "re-recorded from iteration 0 (its published tables and checkpoints are found, not made "
                             "again)") from None
    n = min(len(history), len(lineage), s.pipeline.iterations)
    if n == 0 or not store.exists(layout.checkpoint_rel(n)):
        return [], []
    return history[:n], [[_own_checkpoint(store, layout, a) if a.kind == "dcp" else a for a in it]
                         for it in lineage[:n]]


def _own_checkpoint(store, layout, a: Artifact) -> Artifact:
    """A recorded trainer-state handle read from this run's own files: its place in the run
    (``runs/<id>/...``, from its URI under this root, or under the root that recorded it when the
    artifact root was copied or moved) on this root, never the recorded path itself, which may name
    the original root's copy. A handle of another run is a ``RunRecordError``: resuming from it
    would continue someone else's policy."""
    own = layout.rel("")
    rel = store.rel_of(a.uri)
    if rel is None and f"/{own}" in a.uri:  # recorded under another root: the same place in this one
        rel = a.uri[a.uri.rindex(f"/{own}") + 1:]
    if rel is None or not rel.startswith(own):
        raise RunRecordError(f"{store.uri(layout.lineage)} names a trainer state outside this run ({a.uri}); "
                             f"restore the run's own lineage.json, or delete it and metrics.json to have the run "
                             "re-recorded from its own files (its published tables and checkpoints are found, "
                             "not made again)")
    inner = inner_path(a.path, rel)
    local = store.local_path(rel)
    return dataclasses.replace(a, uri=store.uri(rel), path=str(local / inner if inner else local))


def finished_summary(s: RLSettings) -> dict | None:
    """The recorded ``summary.json`` of a run that has finished at least ``iterations`` iterations
    (its final evaluation done, its records and latest checkpoint in place), else None. Replaying
    such a run returns this instead of evaluating again and rewriting its stage timings."""
    store, layout = _files(s)
    if not store.exists(layout.summary):
        return None
    recorded = read_record(store, layout.summary)
    n = recorded.get("iterations")
    if not isinstance(n, int) or n < s.pipeline.iterations:
        return None
    history, done = finished_iterations(dataclasses.replace(s, pipeline=dataclasses.replace(s.pipeline, iterations=n)))
    return recorded if len(history) == len(done) == n else None


def recorded_prepare_seconds(s: RLSettings) -> dict[str, float] | None:
    """The prepare stages' seconds of the run's last summary (``prepare_<stage>`` entries), or None."""
    store, layout = _files(s)
    if not store.exists(layout.summary):
        return None
    per_stage = read_record(store, layout.summary).get("seconds_per_stage") or {}
    out = {k[len("prepare_"):]: v for k, v in per_stage.items() if k.startswith("prepare_")}
    return out or None


def publish_iteration(s: RLSettings, history: list[dict], lineage: list[Artifact], final: dict | None = None) -> None:
    """Write ``metrics.json`` and the curves PNG beside the run's artifacts; inside a flow run, also
    publish the UI artifacts listed in the module docstring. ``history``: one metrics dict per
    iteration done; ``lineage``: every artifact of the run so far, oldest first; ``final``: the run's
    summary (last publication only)."""
    store, layout = _files(s)
    run_id = s.pipeline.run_id
    png = curves_png(history)
    store.replace_text(layout.metrics, json.dumps(history, indent=1))
    with store.publish(layout.curves_rel(len(history))) as tmp:
        tmp.write_bytes(png)
    if not _in_flow():
        return
    columns = TABLE_COLUMNS + [c for c in EPISODE_COLUMNS if any(c in h for h in history)]
    rows = [{c: table_number(h.get(c, "")) for c in columns} for h in history]
    _report(create_table_artifact, TableArtifact(table=rows).format(), rows, "metrics", run_id,
            f"run {run_id}: one row per RL iteration")
    md = lineage_markdown(s, lineage)
    _report(create_markdown_artifact, md, md, "lineage", run_id, f"run {run_id}: where every artifact came from")
    b64 = base64.b64encode(png).decode()
    text = f"### run `{run_id}`: reward and KL\n\n![reward and KL curves](data:image/png;base64,{b64})\n"
    if final:
        text += "\n" + "\n".join(f"- **{k}**: {table_number(v)}" for k, v in final.items() if not isinstance(v, dict))
    _report(create_markdown_artifact, text, text, "curves", run_id, f"run {run_id}: reward / KL curves")
    md = checkpoints_markdown(s, lineage)
    _report(create_markdown_artifact, md, md, "checkpoints", run_id, f"run {run_id}: checkpoints and validation report")
    _publish_progress(s, len(history))


def _report(create, data: str, value, kind: str, run_id: str, description: str) -> None:
    """One report of the run: created on the flow run's first publication, then updated in place
    (``PATCH /artifacts/{id}``), so the flow run's Artifacts tab holds one card per report showing
    the run's current state, not one version per iteration. ``data``: the formatted payload of an
    update; ``value``: what ``create`` takes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    ident = (FlowRunContext.get().flow_run.id, kind)
    if ident not in _report_ids:
        _report_ids[ident] = create(value, key=artifact_key(kind, run_id), description=description)
        return
    with get_client(sync_client=True) as client:
        client.update_artifact(_report_ids[ident], ArtifactUpdate(data=data, description=description))


def _publish_progress(s, done: int) -> None:
    run_id = FlowRunContext.get().flow_run.id
    total = s.pipeline.iterations
    pct = 100.0 * done / max(total, 1)
    desc = f"run {s.pipeline.run_id}: {done} of {total} iterations"
    if run_id not in _progress_ids:
        _progress_ids[run_id] = create_progress_artifact(pct, key=artifact_key("progress", s.pipeline.run_id), description=desc)
    else:
        update_progress_artifact(_progress_ids[run_id], pct, description=desc)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summary(s: RLSettings, prepare_seconds: dict[str, float], history: list[dict], final: dict, wall: float,
            prepare_memory: dict | None = None, device: str = "cpu", dtype: str = "float32") -> dict:
    """The run's summary (``summary.json``). ``memory_per_stage``: per stage, the largest peaks of
    ``metrics.json``'s ``memory_<stage>_*`` over the iterations, and the prepare stages' own."""
    ev = [h for h in history if "heldout_reward" in h]
    per_stage: dict[str, float] = {}
    for h in history:
        for k, v in h.items():
            if k.startswith("seconds_") and k != "seconds_iteration":  # the whole body is not a stage
                per_stage[k[8:]] = per_stage.get(k[8:], 0.0) + v
    per_stage.update({f"prepare_{k}": v for k, v in prepare_seconds.items()})
    iteration_seconds = sum(h.get("seconds_iteration", 0.0) for h in history)
    memory: dict[str, dict[str, int]] = {}
    rows = [{k: v for k, v in h.items() if k.startswith("memory_")} for h in history]
    rows.append({k.replace("memory_", "memory_prepare_", 1): v for k, v in (prepare_memory or {}).items()})
    for row in rows:
        for k, v in row.items():
            for field in ("device_peak_bytes", "device_bytes_after", "host_rss_peak_bytes"):
                if k.endswith("_" + field):
                    stage = k[len("memory_"):-len(field) - 1]
                    memory.setdefault(stage, {})[field] = max(memory.get(stage, {}).get(field, 0), v)
    out = {
        "run_id": s.pipeline.run_id, "iterations": len(history), "env": s.pipeline.env, "preset": s.model.preset,
        "heldout_reward_start": ev[0]["heldout_reward"] if ev else None,
        "heldout_reward_end": final["heldout_reward"],
        "heldout_solved_start": ev[0]["heldout_solved"] if ev else None,
        "heldout_solved_end": final["heldout_solved"],
        "heldout_greedy_reward_start": ev[0].get("heldout_greedy_reward") if ev else None,
        "heldout_greedy_reward_end": final.get("heldout_greedy_reward"),
        "train_reward_first": history[0]["reward_mean"] if history else None,
        "train_reward_last": history[-1]["reward_mean"] if history else None,
        "qat": bool(s.grpo.qat),
        # train/inference mismatch per iteration (KL(trainer || W4A8 engine) / KL(trainer || bf16
        # engine)), median over the run; None when the rollouts were not quantised
        "mismatch_kl_ratio_median": _median([h["mismatch_kl_ratio"] for h in history
                                             if h.get("mismatch_kl_ratio") is not None]),
        "wall_seconds": wall,
        "iteration_seconds": round(iteration_seconds, 1),  # the iterations' bodies, end to end
        "seconds_per_stage": {k: round(v, 1) for k, v in per_stage.items()},
        "device": device,
        "dtype": dtype,
        "memory_per_stage": memory,
    }
    store, layout = _files(s)
    store.replace_text(layout.summary, json.dumps(out, indent=2))
    return out
