"""Encoding of the bundled BPE against independent references: tiktoken built straight from the file,
the ``regex`` module for the pre-tokenizer, a plain-Python BPE, ``tokenizers`` and transformers."""

import base64

import pytest
import regex
import tiktoken

from k3core.tokenizer import HFTokenizer, TiktokenTokenizer, load_tokenizer
from k3core.tokenizer.pattern import KIMI_PAT_PIECES, KIMI_PAT_STR, kimi_split
from k3core.tokenizer.specials import K3_SPECIAL_OFFSETS, NUM_SPECIAL


def reference_encoding(directory) -> tiktoken.Encoding:
    """tiktoken from the files by hand: the ranks parsed here, specials by the release's rule."""
    ranks = {}
    for line in (directory / "tiktoken.model").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    n = len(ranks)
    specials = {K3_SPECIAL_OFFSETS.get(i - n, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_SPECIAL)}
    return tiktoken.Encoding("reference", pat_str="|".join(KIMI_PAT_PIECES), mergeable_ranks=ranks,
                             special_tokens=specials)


def naive_bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm, slowly: a whole piece that is a token stays whole; else merge the adjacent
    pair whose joined bytes have the lowest rank, until no pair joins into a token."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], float("inf")))
        if parts[best] + parts[best + 1] not in ranks:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return [ranks[p] for p in parts]


@pytest.fixture(scope="module")
def tok(bundled):
    return TiktokenTokenizer(bundled)


def test_encode_equals_tiktoken_built_from_the_file(tok, bundled, corpus):
    ref = reference_encoding(bundled)
    for text in corpus:
        assert tok.encode(text) == ref.encode(text, allowed_special="all"), text
    assert tok.encode("x", bos=True) == [tok.bos_id] + ref.encode("x")


def test_special_strings_encode_as_their_ids_and_look_alikes_as_text(tok):
    assert tok.encode("<|im_end|>") == [tok.special_ids["<|im_end|>"]]
    assert tok.encode("[BOS]") == [tok.bos_id]
    truncated = tok.encode("<|im_end|")
    assert all(i < tok.n_base for i in truncated) and tok.decode(truncated) == "<|im_end|"


@pytest.mark.parametrize("text, pieces", [
    ("中文字符abc", ["中文字符", "abc"]),
    ("日本語のテキスト", ["日本語", "のテキスト"]),
    ("HelloWorld ABCdef", ["Hello", "World", " ABCdef"]),
    ("12345", ["123", "45"]),
    ("I'M don't", ["I'M", " don't"]),
    ("a  \n\n b", ["a", "  \n\n", " b"]),
])
def test_pat_str_pieces(text, pieces):
    assert kimi_split(text) == pieces
    assert regex.findall(KIMI_PAT_STR, text, flags=regex.V1) == pieces


def test_tiktoken_splits_as_the_regex_module_does(tok, corpus):
    """The plain BPE over ``regex``'s pieces gives tiktoken's ids: both engines cut the same pieces."""
    ranks = tok.encoding._mergeable_ranks
    for text in corpus:
        if "<|" in text or "[BOS]" in text:
            continue  # specials are split out before the regex; covered above
        expected = [i for piece in kimi_split(text) for i in naive_bpe(piece.encode(), ranks)]
        assert tok.encode(text) == expected, text


def test_hf_and_transformers_give_the_tiktoken_ids(tok, bundled, corpus):
    from transformers import AutoTokenizer

    hf = HFTokenizer(bundled)
    auto = AutoTokenizer.from_pretrained(str(bundled))  # no trust_remote_code: tokenizer.json only
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.pad_id) == (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id)
    assert hf.special_ids == tok.special_ids and hf.stop_ids == tok.stop_ids
    assert len(auto) == tok.vocab_size and auto.bos_token_id == tok.bos_id and auto.eos_token_id == tok.eos_id
    for text in corpus:
        ids = tok.encode(text)
        assert hf.encode(text) == ids, text
        assert auto.encode(text, add_special_tokens=False) == ids, text


def test_decode_inverts_encode(tok, bundled, corpus):
    hf = HFTokenizer(bundled)
    for text in corpus:
        assert tok.decode(tok.encode(text)) == text
        assert hf.decode(hf.encode(text)) == text


def test_decode_replaces_invalid_utf8_and_skips_specials(tok, bundled):
    hf = HFTokenizer(bundled)
    ids = [tok.bos_id, *tok.encode("hé")[:-1], 0xFF, tok.eos_id]
    for t in (tok, hf):
        assert "\ufffd" in t.decode(ids)
        assert t.decode(tok.encode("a<|im_end|>b"), skip_special_tokens=True) == "ab"
        assert t.decode(tok.encode("a<|im_end|>b")) == "a<|im_end|>b"


@pytest.mark.parametrize("bad", [-1, 2306, 10**6])
def test_decode_of_an_unknown_id_names_it(bundled, bad):
    for t in (TiktokenTokenizer(bundled), HFTokenizer(bundled)):
        with pytest.raises(ValueError, match=rf"token id {bad} .*2,306 ids"):
            t.decode([1, bad])


def test_demo_strings_cost_one_token_per_letter(bundled):
    tok = load_tokenizer(bundled)
    assert [tok.decode([i]) for i in tok.encode("rev:abcdefgh=")] == ["rev", ":", *"abcdefgh", "="]
    assert len(tok.encode("dcba")) == 4
