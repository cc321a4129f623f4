"""Format detection, byte-tokenizer compatibility, and the errors of bad checkpoints."""

import json
import shutil

import pytest

from k3core.config import K3Config
from k3core.tokenizer import (ByteTokenizer, HFTokenizer, TiktokenTokenizer, Tokenizer, check_against_config,
                              load_tokenizer)


def _copy(bundled, tmp_path, *names):
    for name in names:
        shutil.copy(bundled / name, tmp_path / name)
    return tmp_path


def test_detection_order(bundled, tmp_path):
    assert isinstance(load_tokenizer(bundled), TiktokenTokenizer)  # tiktoken.model first
    assert isinstance(load_tokenizer(_copy(bundled, tmp_path, "tokenizer.json", "tokenizer_config.json")), HFTokenizer)
    empty = tmp_path / "empty"
    empty.mkdir()
    tiny = K3Config.preset("tiny")
    tok = load_tokenizer(empty, tiny)
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)


def test_remote_code_is_never_imported(bundled, tmp_path):
    _copy(bundled, tmp_path, "tiktoken.model", "tokenizer_config.json")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "executed"
    (tmp_path / "tokenization_kimi.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert load_tokenizer(tmp_path).encode("hi") == load_tokenizer(bundled).encode("hi")
    assert not marker.exists()


def test_missing_tokenizer_for_a_non_byte_config_names_files_and_fix(tmp_path):
    with pytest.raises(ValueError) as e:
        load_tokenizer(tmp_path, K3Config.preset("medium"))
    for part in (str(tmp_path), "tiktoken.model", "tokenizer.json", "k3rl checkpoint init --tokenizer"):
        assert part in str(e.value)
    with pytest.raises(ValueError, match="no model config was given"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_corrupt_tiktoken_line_names_file_and_line(bundled, tmp_path):
    _copy(bundled, tmp_path, "tokenizer_config.json")
    lines = (bundled / "tiktoken.model").read_text().splitlines()
    lines[6] = "!!notbase64 6"
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"tiktoken\.model, line 7: not a 'base64-token rank' line"):
        load_tokenizer(tmp_path)
    lines[6] = lines[7]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="line 8: token .* appears twice"):
        load_tokenizer(tmp_path)


def test_check_against_config(bundled):
    tok = load_tokenizer(bundled)
    with pytest.raises(ValueError) as e:
        check_against_config(tok, K3Config.preset("tiny"))
    msg = str(e.value)
    assert "tiktoken.model gives 2,306 ids but config.json's vocab_size is 260" in msg
    assert "bos at id 2048 but config.json's bos_token_id is 256" in msg and "Fix:" in msg
    fits = K3Config.preset("tiny")
    fits.vocab_size, fits.bos_token_id, fits.eos_token_id, fits.pad_token_id = 2306, 2048, 2049, 2303
    check_against_config(tok, fits)
    check_against_config(ByteTokenizer(K3Config.preset("tiny")), K3Config.preset("tiny"))


def test_the_release_rule_of_258_ids_is_bounded_by_the_model(bundled):
    """The release's rule gives n_base + 258 ids; its config has room for n_base + 256: with the
    config, the two trailing unnamed reserved ids are not made."""
    cfg = K3Config.preset("tiny")
    cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 2048 + 256, 2048, 2049, 2303
    tok = load_tokenizer(bundled, cfg)
    assert tok.vocab_size == 2048 + 256 and "<|reserved_token_2304|>" not in tok.special_ids
    check_against_config(tok, cfg)
    assert load_tokenizer(bundled).vocab_size == 2048 + 258


def test_byte_tokenizer_keeps_its_old_behaviour():
    tiny = K3Config.preset("tiny")
    tok = ByteTokenizer(tiny)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (260, 256, 257, 258)
    assert tok.encode("hé") == [256, 104, 195, 169] and tok.encode("hé", bos=False) == [104, 195, 169]
    assert tok.decode([256, 104, 195, 169, 259, 257, 258]) == "hé"  # specials and unused ids dropped
    assert tok.decode([0xC3]) == "\ufffd" and tok.stop_ids == (257,)
    with pytest.raises(ValueError, match="token id 260 .* 260 ids"):
        tok.decode([104, 260])
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        ByteTokenizer(K3Config(vocab_size=200, bos_token_id=1, eos_token_id=2, pad_token_id=3))
