"""The builder: deterministic, and the checked-in files are what it builds."""

import pytest

from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer
from k3core.tokenizer.build_bpe import build, corpus, is_letter_run

FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build(tmp_path_factory.mktemp("k3-bpe"))


def test_build_is_deterministic_and_matches_the_bundled_files(built, tmp_path):
    again = build(tmp_path)
    for name in FILES:
        assert (again / name).read_bytes() == (built / name).read_bytes(), name
        assert (BUNDLED_K3_BPE / name).read_bytes() == (built / name).read_bytes(), (
            f"bundled {name} is stale: run `python -m k3core.tokenizer.build_bpe {BUNDLED_K3_BPE}`")
        assert (BUNDLED_K3_BPE / name).stat().st_size < 300_000


def test_vocabulary_layout(built):
    tok = load_tokenizer(built)
    ranks = tok.encoding._mergeable_ranks
    assert tok.n_base == 2048 and tok.vocab_size == 2048 + 258
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert not [t for t in ranks if is_letter_run(t)]
    offsets = {name: i - 2048 for name, i in tok.special_ids.items() if not name.startswith("<|reserved")}
    assert offsets == {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
                       "<|start_header_id|>": 6, "<|end_header_id|>": 7, "[EOT]": 9, "<|im_system|>": 10,
                       "<|tool_calls_section_begin|>": 11, "<|tool_calls_section_end|>": 12,
                       "<|tool_call_begin|>": 13, "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15,
                       "<|im_middle|>": 17, "[UNK]": 254, "[PAD]": 255}
    assert tok.special_ids["<|reserved_token_2053|>"] == 2053 and tok.pad_id == 2048 + 255


def test_corpus_is_a_function_of_its_seed():
    assert corpus(0)[-500:] == corpus(0)[-500:] and corpus(0) != corpus(1)
