"""The supervised warm-up's schedule: the copy phase's sequences are the environment's own training
prompts repeated back in a bare conversation, and the reference phase after it teaches exactly what
a warm-up without a copy phase teaches (its prompt stream is untouched)."""

import re

import pytest
import torch

import k3core.rl.warmup as warmup
from k3core.config import K3Config
from k3core.checkpoint.hf import _with_tokenizer
from k3core.model import K3ForCausalLM
from k3core.rl.envs import load_env
from k3core.rl.prompting import PromptFormat
from k3core.settings import COPY_BATCH_FACTOR
from k3core.tokenizer import BUNDLED_K3_BPE, ByteTokenizer, load_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


def _recorded(monkeypatch, env_spec, fmt, steps, copy_steps, batch=2):
    """The batches ``supervised_warmup`` hands to ``sft_step``, and its metrics."""
    seen = []
    from k3core.rl.train import sft_step as real

    def spy(model, opt, seqs, pad_id, **kw):
        seen.append([(list(s.prompt_ids), list(s.output_ids), None if s.loss_mask is None else list(s.loss_mask))
                     for s in seqs])
        return real(model, opt, seqs, pad_id, **kw)

    monkeypatch.setattr(warmup, "sft_step", spy)
    cfg = K3Config.preset("tiny")
    if fmt.chat:
        cfg = _with_tokenizer(cfg, "bpe")[0]
    model = K3ForCausalLM(cfg)
    model.reset_parameters(0)
    out = warmup.supervised_warmup(model, load_env(env_spec), env_spec, fmt, steps, batch, 1e-3, 0,
                                   copy_steps=copy_steps)
    return seen, out


def test_copy_sequences_repeat_training_prompts_in_a_bare_chat():
    tok = load_tokenizer(BUNDLED_K3_BPE)
    env = load_env("tools-calc")
    fmt = PromptFormat.of(tok, env)
    seq = warmup.copy_sequence(fmt, "Compute 123*456.")
    # Independently: the template over one user turn (no system turn, no tool declaration), then the
    # prompt's text as the answer and the end-of-turn id.
    assert seq.prompt_ids == tok.apply_chat_template([{"role": "user", "content": "Compute 123*456."}],
                                                     add_generation_prompt=True)
    assert seq.output_ids == tok.encode("Compute 123*456.", bos=False) + [fmt.end_id]
    text = tok.decode(seq.prompt_ids)
    assert "calculator" not in text and env.system_prompt not in text
    raw = PromptFormat.of(ByteTokenizer(K3Config.preset("tiny")), load_env("reverse"), mode="raw")
    seq = warmup.copy_sequence(raw, "abc")
    assert seq.prompt_ids == raw.prompt_ids("abc") and seq.output_ids == list(b"abc") + [raw.end_id]


def test_copy_phase_comes_first_and_leaves_the_reference_phase_as_it_was(monkeypatch):
    tok = load_tokenizer(BUNDLED_K3_BPE)
    fmt = PromptFormat.of(tok, load_env("tools-calc"))
    plain, plain_out = _recorded(monkeypatch, "tools-calc", fmt, steps=2, copy_steps=0)
    both, out = _recorded(monkeypatch, "tools-calc", fmt, steps=2, copy_steps=3)
    assert len(both) == 5 and [len(b) for b in both[:3]] == [COPY_BATCH_FACTOR * 2] * 3
    for batch in both[:3]:  # tools-calc says what its episodes copy: the operands of its prompts
        for prompt_ids, output_ids, mask in batch:
            asked = tok.decode(prompt_ids).split("<|im_middle|>")[-2].removesuffix("<|im_end|><|im_assistant|>assistant")
            assert tok.decode(output_ids[:-1]) == asked and re.fullmatch(r"\d{3}\*\d{3}", asked) and mask is None
    assert both[3:] == plain  # the reference steps see the same episodes, in the same order
    assert out["warmup_copy_steps"] == 3 and out["warmup_steps"] == 2 and plain_out.get("warmup_copy_steps") is None
    # Distinct prompts in the copy phase's stream: it draws its own, not the reference phase's again.
    copied = {tuple(p) for b in both[:3] for p, _, _ in b}
    assert len(copied) > COPY_BATCH_FACTOR * 2


def test_without_copied_the_copy_phase_repeats_the_prompt(monkeypatch):
    class Plain:
        def prompts(self, rng, n):
            return [f"say {rng.randint(10, 99)}" for _ in range(n)]

    seen, real = [], warmup.copy_sequence
    monkeypatch.setattr(warmup, "copy_sequence", lambda fmt, text: seen.append(text) or real(fmt, text))
    fmt = PromptFormat.of(ByteTokenizer(K3Config.preset("tiny")), Plain(), mode="raw")
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(0)
    warmup.supervised_warmup(model, Plain(), "mine:make", fmt, 0, 1, 1e-3, 0, copy_steps=1)
    assert len(seen) == COPY_BATCH_FACTOR and all(re.fullmatch(r"say \d\d", t) for t in seen)


def test_copy_steps_alone_need_no_reference(monkeypatch):
    class NoReference:
        def prompts(self, rng, n):
            return [f"x{rng.randint(0, 9)}" for _ in range(n)]

        def reward(self, prompt, completion):
            return 0.0

    fmt = PromptFormat.of(ByteTokenizer(K3Config.preset("tiny")), NoReference(), mode="raw")
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.reset_parameters(0)
    out = warmup.supervised_warmup(model, NoReference(), "mine:make", fmt, 0, 2, 1e-3, 0, copy_steps=2)
    assert out["warmup_copy_steps"] == 2 and out["warmup_copy_loss_last"] > 0
    with pytest.raises(ValueError, match="no reference"):
        warmup.supervised_warmup(model, NoReference(), "mine:make", fmt, 1, 2, 1e-3, 0)


def test_the_copy_phase_teaches_copying_on_tiny():
    """A learning check against a closed form: ``reverse``'s prompts are ``rev:`` and 3-6 letters
    drawn uniformly from 8, so a model that does not copy predicts a letter of the repeated prompt
    right 1 time in 8 in expectation (the letters are independent of all it does not read: 0.125 +-
    0.02 over these 64 prompts' ~290 letters); after 40 copy steps the tiny model predicts more than
    twice that (0.30 when measured)."""
    import random

    from k3core.rl.train import pack_sequences

    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    env = load_env("reverse")
    fmt = PromptFormat.of(ByteTokenizer(cfg), env, mode="raw")
    model = K3ForCausalLM(cfg)
    model.reset_parameters(0)
    letters = torch.tensor([ord(c) for c in env.alphabet])

    def letter_accuracy():
        seqs = [warmup.copy_sequence(fmt, p) for p in env.prompts(random.Random("fresh"), 64)]
        b = pack_sequences(seqs, fmt.pad_id)
        with torch.no_grad():
            pred = model(b["input_ids"], b["valid"], return_logits=True).logits.argmax(-1)
        at = b["gen_mask"].bool() & torch.isin(b["targets"], letters)  # the answer's letters
        return float((pred[at] == b["targets"][at]).float().mean())

    before = letter_accuracy()
    warmup.supervised_warmup(model, env, "reverse", fmt, 0, 8, 3e-3, 0, copy_steps=40)
    after = letter_accuracy()
    assert before < 0.2 and after > 0.25
