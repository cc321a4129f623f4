"""What a run shows in the Prefect UI (the open-source UI has no asset graph): the ``rl-metrics``
table, a markdown lineage table, reward/KL curves rendered inside markdown, and links to checkpoints
and the validation report. Also writes the same curves as a PNG and the summary as JSON beside the
run's artifacts."""

from __future__ import annotations

import base64
import io
import json

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.context import FlowRunContext

from k3core.artifacts import ArtifactStore

TABLE_COLUMNS = ["iteration", "weight_version", "reward_mean", "reward_std", "solved_fraction", "heldout_reward", "heldout_greedy_reward",
                 "kl_rollout_trainer_k3", "clip_fraction", "entropy", "grad_norm", "response_length_mean",
                 "tis_weight_mean", "train_tokens_per_s", "seconds_rollout", "seconds_train", "transfer_seconds"]


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
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def publish_iteration(s, history: list[dict], lineage: list, prep: dict, final: dict | None = None) -> None:
    store = ArtifactStore(s.artifacts)
    png = curves_png(history)
    store.replace_text(f"runs/{s.run_id}/metrics.json", json.dumps(history, indent=1))
    with store.publish(f"runs/{s.run_id}/curves-{len(history):04d}.png") as tmp:
        tmp.write_bytes(png)
    if not _in_flow():
        return
    rows = [{c: (round(h[c], 5) if isinstance(h.get(c), float) else h.get(c, "")) for c in TABLE_COLUMNS}
            for h in history]
    create_table_artifact(rows, key="rl-metrics", description=f"run {s.run_id}: one row per RL iteration")
    md = ["| artifact | kind | sha256 | produced by | inputs |", "|---|---|---|---|---|"]
    base = [("source checkpoint", prep["checkpoint"]["uri"], prep["checkpoint"]["sha256"], "fetch_checkpoint",
             [prep["checkpoint"]["source"]]),
            ("validation report", prep["report"]["uri"], "", "validate_checkpoint", [prep["checkpoint"]["uri"]])]
    if prep["policy"]["uri"] != prep["checkpoint"]["uri"]:
        base.append(("warmed-up policy", prep["policy"]["uri"], prep["policy"]["sha256"], "warmup",
                     [prep["checkpoint"]["uri"]]))
    if prep["weights"]["uri"] != prep["policy"]["uri"]:
        base.append(("rollout weights v0 (MXFP4)", prep["weights"]["uri"], prep["weights"]["sha256"],
                     "quantize_mxfp4", [prep["policy"]["uri"]]))
    for kind, uri, sha, task, inputs in base + list(lineage):
        md.append(f"| `{uri}` | {kind} | `{sha[:12]}` | {task} | {'<br>'.join(f'`{i}`' for i in inputs)} |")
    create_markdown_artifact("\n".join(md), key="rl-lineage", description=f"run {s.run_id}: where every artifact came from")
    b64 = base64.b64encode(png).decode()
    text = f"### run `{s.run_id}`: reward and KL\n\n![reward and KL curves](data:image/png;base64,{b64})\n"
    if final:
        text += "\n" + "\n".join(f"- **{k}**: {v}" for k, v in final.items() if not isinstance(v, dict))
    create_markdown_artifact(text, key="rl-curves", description="reward / KL curves")
    last_ck = next((x for x in reversed(lineage) if x[0] == "checkpoint"), None)
    if last_ck:
        create_link_artifact(last_ck[1], link_text=f"latest checkpoint ({s.run_id})", key="rl-latest-checkpoint")
    create_link_artifact(prep["report"]["uri"], link_text="validation report", key="rl-validation-report")


def summary(s, prep: dict, history: list[dict], final: dict, wall: float) -> dict:
    ev = [h for h in history if "heldout_reward" in h]
    per_stage: dict[str, float] = {}
    for h in history:
        for k, v in h.items():
            if k.startswith("seconds_"):
                per_stage[k[8:]] = per_stage.get(k[8:], 0.0) + v
    per_stage.update({f"prepare_{k}": v for k, v in prep["seconds"].items()})
    out = {
        "run_id": s.run_id, "iterations": len(history), "env": s.env, "preset": s.preset,
        "heldout_reward_start": ev[0]["heldout_reward"] if ev else None,
        "heldout_reward_end": final["heldout_reward"],
        "heldout_solved_start": ev[0]["heldout_solved"] if ev else None,
        "heldout_solved_end": final["heldout_solved"],
        "heldout_greedy_reward_start": ev[0].get("heldout_greedy_reward") if ev else None,
        "heldout_greedy_reward_end": final.get("heldout_greedy_reward"),
        "train_reward_first": history[0]["reward_mean"] if history else None,
        "train_reward_last": history[-1]["reward_mean"] if history else None,
        "wall_seconds": wall,
        "seconds_per_stage": {k: round(v, 1) for k, v in per_stage.items()},
    }
    ArtifactStore(s.artifacts).replace_text(f"runs/{s.run_id}/summary.json", json.dumps(out, indent=2))
    return out
