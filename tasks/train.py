"""Stage 6, train_step: one GRPO update (PPO clipping, TIS correction, routing replay) of the trainer
state on a scored batch; the new trainer state (model, optimizer, RNG, data cursor) is written with
torch.distributed.checkpoint into a staged directory that save_checkpoint then commits."""

from __future__ import annotations

import json

from prefect import get_run_logger

from k3core.artifacts import ArtifactStore, sha256_tree


def train_step(state: dict, scored: dict, iteration: int, lr: float, clip_eps_low: float, clip_eps_high: float,
               tis_cap: float, routing_replay: bool, temperature: float, artifact_root: str, rel: str,
               qat: bool = False) -> dict:
    """``qat``: train with MXFP4 fake-quantised routed experts (straight-through); it is saved with
    the trainer state, and resuming a state with the other setting is refused."""
    import pyarrow.parquet as pq

    from k3core.rl.stages import (QAT_KEY, load_policy, load_trainer_state, make_optimizer, save_trainer_state,
                                  set_qat, train_on_table)
    from k3core.rl.train import GRPOConfig
    from k3core.tokenizer import ByteTokenizer

    store = ArtifactStore(artifact_root)
    if not store.exists(rel):
        if state["kind"] == "dcp":
            model, opt, extra = load_trainer_state(state["path"], lr)
            was = bool(extra.get(QAT_KEY, False))
            if was != qat:
                onoff = {True: "on", False: "off"}
                raise ValueError(f"trainer state {state['uri']} was trained with QAT {onoff[was]}, this run asks "
                                 f"for QAT {onoff[bool(qat)]}: resume with --qat {str(was).lower()}, or start a new --run-id")
        else:  # the first iteration starts from a public-layout checkpoint with a fresh optimizer
            model = set_qat(load_policy(state["path"]), qat)
            opt = make_optimizer(model, lr)
        cfg = GRPOConfig(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, tis_cap=tis_cap,
                         routing_replay=routing_replay, temperature=temperature)
        metrics = train_on_table(model, opt, pq.read_table(scored["path"]), cfg, ByteTokenizer(model.config).pad_id)
        extra = {"iteration": iteration + 1, "data_cursor": {"next_iteration": iteration + 1},
                 "parent": state["uri"], "scored": scored["uri"], "metrics": metrics}
        with store.publish(rel, is_dir=True) as tmp:
            save_trainer_state(tmp / "state", model, opt, extra, storage_writer_factory=_writer_factory())
        get_run_logger().info(f"iteration {iteration}: loss {metrics.get('loss', 0):.4f} "
                              f"grad norm {metrics.get('grad_norm', 0):.3f}")
    local = store.open_local(rel) / "state"
    extra = json.loads((local / "extra.json").read_text())
    return {"uri": store.uri(rel), "path": str(local), "sha256": sha256_tree(local), "kind": "dcp",
            "version": iteration + 1, "metrics": extra["metrics"], "qat": bool(extra.get(QAT_KEY, False))}


def _writer_factory():
    """The O_DIRECT writer (fixed host memory, no page-cache growth) where available."""
    try:
        from k3core.checkpoint.odirect import ODirectFileSystemWriter
    except ImportError:  # pragma: no cover
        return None
    return lambda path: ODirectFileSystemWriter(path)
