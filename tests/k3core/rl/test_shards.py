"""Rollout shards (k3core.rl.shards): the merged shard tables against the one-engine rollout table
(the reference: ``rollout_table`` over every prompt in one call), and a worker's resident engines
(built once, pushed newer versions, older ones refused)."""

import copy

import pyarrow as pa
import pytest
import torch

from k3core.rl.prompting import PromptFormat
from k3core.checkpoint.hf import init_checkpoint, quantize_checkpoint
from k3core.rl.data import training_prompts
from k3core.rl.envs import load_env
from k3core.rl.shards import ResidentEngines, StaleWeightVersion, merge_shards, shard_bounds, shard_table
from k3core.rl.tables import rollout_table
from k3core.rl.trainer_state import load_trainer_model, make_optimizer, save_trainer_state
from k3core.rl.weights import build_engine, engine_from_model, load_policy
from k3core.rollout.engine import SamplingParams
from k3core.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tiny")
    init_checkpoint("tiny", root / "bf16", seed=0)
    quantize_checkpoint(root / "bf16", root / "mxfp4")
    return root


def test_shard_bounds_cover_every_prompt_once_in_order():
    for prompts in range(0, 12):
        for shards in range(1, 6):
            b = shard_bounds(prompts, shards)
            assert len(b) == shards and b[0][0] == 0 and b[-1][1] == prompts
            assert all(b[k][1] == b[k + 1][0] for k in range(shards - 1))
            sizes = [stop - start for start, stop in b]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="shards must be >= 1"):
        shard_bounds(4, 0)


@pytest.mark.parametrize("shards", [2, 3, 7])
def test_merged_shards_equal_the_one_engine_rollout(tiny, shards):
    """Shards of 5 prompts (7 shards: some empty) on one engine, merged, equal one call over all."""
    engine = build_engine(tiny / "mxfp4", 0)
    tok = ByteTokenizer(engine.model.config)
    prompts = training_prompts(load_env("reverse"), 0, 0, 5, "reverse")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, stop_token_ids=(tok.eos_id,), seed=17)
    whole = rollout_table(engine, PromptFormat.of(tok, mode="raw"), prompts, params, 0, first_prompt_index=10)
    parts = [shard_table(engine, PromptFormat.of(tok, mode="raw"), prompts, b, params, 0, 10, f"w{k}") for k, b in enumerate(shard_bounds(5, shards))]
    merged = merge_shards(list(reversed(parts)), 5, 3, first_prompt_index=10)  # arrival order does not matter
    for col in whole.column_names:
        if col == "worker":
            continue
        if col == "logprobs":  # batch composition may change rounding only (module docstring of k3core.rl.shards)
            for a, b in zip(merged.column(col).to_pylist(), whole.column(col).to_pylist()):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
        else:
            assert merged.column(col).to_pylist() == whole.column(col).to_pylist(), col
    bounds = shard_bounds(5, shards)
    want_workers = [f"w{k}" for k, (a, b) in enumerate(bounds) for _ in range(a, b) for _ in range(3)]
    assert merged.column("worker").to_pylist() == want_workers


def test_merge_refuses_missing_or_doubled_rows(tiny):
    engine = build_engine(tiny / "mxfp4", 0)
    tok = ByteTokenizer(engine.model.config)
    prompts = training_prompts(load_env("reverse"), 0, 0, 2, "reverse")
    params = SamplingParams(max_new_tokens=2, temperature=1.0, n=2, stop_token_ids=(tok.eos_id,), seed=1)
    a, b = (shard_table(engine, PromptFormat.of(tok, mode="raw"), prompts, bd, params, 0, 0, "w") for bd in shard_bounds(2, 2))
    with pytest.raises(ValueError, match=r"2 \(prompt, sample\) pairs missing \(first \[\(1, 0\)"):
        merge_shards([a], 2, 2)
    with pytest.raises(ValueError, match="2 doubled"):
        merge_shards([a, a, b], 2, 2)
    assert merge_shards([b, a], 2, 2).equals(pa.concat_tables([a, b]))


def test_resident_engine_is_built_once_pushed_newer_versions_and_refuses_older(tiny, tmp_path):
    holder = ResidentEngines()
    e0 = holder.engine("r", tiny / "mxfp4", "checkpoint", 0, True)
    assert holder.engine("r", tiny / "mxfp4", "checkpoint", 0, True) is e0 and holder.builds == 1

    # version 1: a trainer state (DCP) with changed weights
    model = load_policy(tiny / "bf16")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_trainer_state(tmp_path / "v1", model, make_optimizer(model, 1e-3), {"iteration": 1})
    e1 = holder.engine("r", tmp_path / "v1", "dcp", 1, True)
    assert e1 is e0 and e1.weight_version == 1 and (holder.builds, holder.pushes) == (1, 1)

    # the pushed engine samples what an engine built from that state samples
    fresh = engine_from_model(copy.deepcopy(load_trainer_model(tmp_path / "v1")), 1, quantized=True)
    tok = ByteTokenizer(fresh.model.config)
    prompts = training_prompts(load_env("reverse"), 0, 3, 3, "reverse")
    params = SamplingParams(max_new_tokens=5, temperature=1.0, n=2, stop_token_ids=(tok.eos_id,), seed=5)
    want, got = (rollout_table(e, PromptFormat.of(tok, mode="raw"), prompts, params, 1) for e in (fresh, e1))
    assert got.column("output_ids").to_pylist() == want.column("output_ids").to_pylist()
    assert got.column("logprobs").to_pylist() == want.column("logprobs").to_pylist()

    with pytest.raises(StaleWeightVersion, match="serves weight version 1, a rollout asked for the older version 0"):
        holder.engine("r", tiny / "mxfp4", "checkpoint", 0, True)
    assert holder.versions() == {"r": 1}
