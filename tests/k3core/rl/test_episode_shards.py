"""Rollout shards of an agentic environment (``--task-runner dask|ray``): a worker's
``ResidentEngines`` receives the environment's spec and episode limits in the ``ShardRequest``, loads
the environment there and runs whole episodes, and the shards' rows merge into the rows one engine
gives for the same rollout: the same episodes (prompt and sample positions, ids, loss masks, turns,
per-token versions), log-probabilities to rounding (batch composition differs)."""

import json

import torch

from k3core.checkpoint.hf import init_checkpoint
from k3core.rl.envs import load_env
from k3core.rl.episodes import EpisodeLimits
from k3core.rl.prompting import PromptFormat, env_messages
from k3core.rl.shards import ResidentEngines, ShardRequest, merge_shards, shard_bounds
from k3core.rollout.engine import SamplingParams
from k3core.tokenizer import load_tokenizer


def test_agentic_shards_merge_into_the_one_engine_rollout(tmp_path):
    init_checkpoint("tiny", tmp_path / "ck", seed=0, tokenizer="bpe")
    tok = load_tokenizer(tmp_path / "ck")
    fmt = PromptFormat.of(tok, load_env("tools-calc"))
    prompts = tuple(f"Compute {100 + 7 * i}*{300 + i}." for i in range(5))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=4, stop_token_ids=fmt.stop_ids)

    def request(run_id, bounds):
        return ShardRequest(run_id, str(tmp_path / "ck"), "checkpoint", 0, False, prompts, bounds, params, 0,
                            tokenizer=str(tmp_path / "ck"), chat=True, env="tools-calc",
                            episode_limits=EpisodeLimits(max_turns=3, max_tokens=48))

    want = ResidentEngines().rollout(request("one", (0, len(prompts))), "local")
    holder = ResidentEngines()
    parts = [holder.rollout(request("sharded", b), str(k)) for k, b in enumerate(shard_bounds(len(prompts), 2))]
    got = merge_shards(parts, len(prompts), 2)
    assert got.num_rows == want.num_rows == 10 and holder.builds == 1
    for col in want.column_names:
        if col == "logprobs":
            for a, b in zip(got.column(col).to_pylist(), want.column(col).to_pylist()):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
        elif col == "worker":
            assert got.column(col).to_pylist() == ["0"] * 4 + ["1"] * 6
        else:
            assert got.column(col).to_pylist() == want.column(col).to_pylist(), col
    for r in got.to_pylist():  # episodes, not single-turn rows: rendered with the tools, masked, with turns
        messages = env_messages(fmt.env, r["prompt"])
        assert r["prompt_ids"] == tok.apply_chat_template(messages, tools=fmt.env.tools, add_generation_prompt=True)
        assert len(r["loss_mask"]) == len(r["output_ids"]) and json.loads(r["turns"])[0]["role"] == "assistant"
        assert r["token_versions"] == [0 if m else None for m in r["loss_mask"]]

