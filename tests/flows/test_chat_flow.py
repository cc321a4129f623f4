"""`k3rl run` on a checkpoint that carries its own tokenizer (the bundled BPE, `init:tiny:0:bpe`), in
Prefect's embedded mode: the run's tokenizer is published beside the source and travels with the
rollout weights; every rollout row's prompt ids are the chat template's rendering of the prompt as a
user turn (what the engine saw), its completion is the decoded sampled ids without the end-of-turn
token, and a stop id appears only as the last sampled id."""

import pyarrow.parquet as pq

from flows.pipeline import RLSettings, rl_run
from k3core.rl import engines, trainers
from k3core.tokenizer import load_tokenizer


def test_a_bpe_checkpoint_runs_on_chat_prompts_token_in_token_out(tmp_path, prefect_harness):
    engines.clear()
    trainers.clear()
    s = RLSettings.from_dict(dict(preset="tiny", source="init:tiny:0:bpe", iterations=1, artifacts=str(tmp_path),
                                  run_id="chat", prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=6,
                                  warmup_steps=2, warmup_batch=4, eval_prompts=4, eval_every=0,
                                  mismatch_sequences=0))
    summary = rl_run(s)
    assert summary["iterations"] == 1
    run = tmp_path / "runs" / "chat"
    tok = load_tokenizer(run / "tokenizer")
    assert tok.chat_template is not None and tok.vocab_size == 2306
    for served in (run / "rollout-weights-v0" / "ckpt", run / "warmup" / "ckpt"):
        assert load_tokenizer(served).encode("rev:abc=") == tok.encode("rev:abc=")  # a server finds it there
    rows = pq.read_table(run / "iter-0000" / "rollouts.parquet").to_pylist()
    assert len(rows) == 16
    for r in rows:
        assert r["prompt_ids"] == tok.apply_chat_template([{"role": "user", "content": r["prompt"]}])
        ids = r["output_ids"]
        assert not set(ids[:-1]) & set(tok.stop_ids)
        assert r["completion"] == tok.decode(ids[:-1] if ids[-1] in tok.stop_ids else ids)
