"""How an environment's prompt becomes ids (``k3core.rl.prompting``), checked against the tokenizer
called by hand: raw text after bos, or chat turns in the template; the environment's
``system_prompt`` and ``messages`` hooks; taught answers end as a sampled completion ends."""

import pytest

from k3core.config import K3Config
from k3core.rl.prompting import PromptFormat, env_messages
from k3core.tokenizer import BUNDLED_K3_BPE, ByteTokenizer, load_tokenizer


class _Env:
    system_prompt = "Reverse the letters."


class _Turns:
    def messages(self, prompt):
        return [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": prompt}]


@pytest.fixture(scope="module")
def bpe():
    return load_tokenizer(BUNDLED_K3_BPE)


def test_auto_is_chat_with_a_template_and_raw_for_bytes(bpe):
    byte = ByteTokenizer(K3Config.preset("tiny"))
    raw = PromptFormat.of(byte)
    assert not raw.chat and raw.prompt_ids("rev:ab=") == [byte.bos_id, *b"rev:ab="]
    assert raw.stop_ids == (byte.eos_id,) and raw.answer_ids("ba") == [*b"ba", byte.eos_id]
    chat = PromptFormat.of(bpe)
    assert chat.chat and chat.prompt_ids("rev:ab=") == bpe.apply_chat_template([{"role": "user", "content": "rev:ab="}])
    assert set(chat.stop_ids) == {bpe.special_ids["[EOS]"], bpe.special_ids["<|im_end|>"]}
    assert chat.answer_ids("ba") == bpe.encode("ba") + [bpe.special_ids["<|im_end|>"]]
    forced_raw = PromptFormat.of(bpe, mode="raw")
    assert forced_raw.prompt_ids("rev:ab=") == [bpe.bos_id, *bpe.encode("rev:ab=")]


def test_environment_hooks_shape_the_conversation(bpe):
    assert env_messages(_Env(), "p") == [{"role": "system", "content": "Reverse the letters."},
                                         {"role": "user", "content": "p"}]
    fmt = PromptFormat.of(bpe, _Turns())
    assert fmt.prompt_ids("p") == bpe.apply_chat_template(_Turns().messages("p"))
    rendered = bpe.decode(PromptFormat.of(bpe, _Env()).prompt_ids("p"))
    assert "Reverse the letters." in rendered and "You are a helpful assistant." not in rendered


def test_completion_text_drops_only_the_stop_that_ended_it(bpe):
    fmt = PromptFormat.of(bpe)
    end = bpe.special_ids["<|im_end|>"]
    ids = bpe.encode("dcba") + [end]
    assert fmt.completion_text(ids) == "dcba"
    assert fmt.completion_text(bpe.encode("dc")) == "dc"  # cut by length: nothing to drop
    section = bpe.encode("<|tool_calls_section_begin|>x")
    assert fmt.completion_text(section + [end]) == "<|tool_calls_section_begin|>x"  # specials inside stay


def test_bad_formats_and_hooks_are_refused(bpe):
    with pytest.raises(ValueError, match="has no chat template"):
        PromptFormat.of(ByteTokenizer(K3Config.preset("tiny")), mode="chat")
    with pytest.raises(ValueError, match="prompt format 'json'"):
        PromptFormat.of(bpe, mode="json")

    class Broken:
        def messages(self, prompt):
            return "not a list"

    with pytest.raises(ValueError, match=r"messages\(prompt\) must return a list"):
        env_messages(Broken(), "p")
