"""Token-in/token-out: a rollout row keeps the ids the engine sampled, and the trainer trains on
those, never on the completion text encoded again. With a BPE tokenizer the two differ whenever the
engine samples a split the tokenizer would not produce (``t``, ``he`` for ``the``): re-encoding would
train the policy on tokens it never chose (the re-tokenization drift peers report)."""

from __future__ import annotations

import torch

from k3core.rl.prompting import PromptFormat
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.rl.tables import rollout_table
from k3core.rl.train import table_to_sequences
from k3core.rl.weights import engine_from_model
from k3core.rollout.engine import SamplingParams
from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer


def test_rollout_rows_and_training_sequences_keep_the_sampled_ids():
    tok = load_tokenizer(BUNDLED_K3_BPE)
    config = K3Config.preset("tiny").replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                             eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    model.reset_parameters(0)
    engine = engine_from_model(model.eval(), 0, quantized=False)
    prompts = ["say the word:", "rev:abcd="]
    fmt = PromptFormat.of(tok)  # the bundled BPE has a chat template: prompts are chat turns
    chat = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=8, seed=5, stop_token_ids=fmt.stop_ids)
    direct = engine.generate(chat, params, pad_id=tok.pad_id)
    table = rollout_table(engine, fmt, prompts, params, 0)
    rows = table.to_pylist()
    seqs = table_to_sequences(table, len(model.moe_layer_ids), config.num_experts_per_token)
    assert [r["output_ids"] for r in rows] == [c.output_ids for c in direct]  # what the engine sampled
    assert [s.output_ids for s in seqs] == [r["output_ids"] for r in rows]  # what the trainer trains on
    assert [s.prompt_ids for s in seqs] == [chat[r["prompt_index"]] for r in rows]
    assert all(r["completion"] == tok.decode([i for i in r["output_ids"] if i not in fmt.stop_ids]) for r in rows)
    drifted = [r for r in rows if tok.encode(r["completion"]) != [i for i in r["output_ids"] if i not in fmt.stop_ids]]
    assert drifted, "no sampled completion re-encodes differently: the test would not see a re-encoding trainer"
