"""A checkpoint's tokenizer travels as data files and is checked against its model: `checkpoint init
--tokenizer bpe` writes the bundled tokenizer (in the manifest, config sized for it), validation
reads it back and fails closed when it does not fit the model, and a preset checks the architecture
while the tokenizer decides the vocabulary."""

from __future__ import annotations

import shutil

import pytest

from k3core.checkpoint.hf import init_checkpoint
from k3core.checkpoint.validate import CheckpointValidationError, validate_checkpoint
from k3core.config import K3Config
from k3core.tokenizer import BUNDLED_K3_BPE, load_tokenizer

TEXT = "<|im_user|>user<|im_middle|>rev:abcd= 12+34= 你好 don't<|im_end|>"


def test_init_with_bpe_writes_the_bundled_tokenizer_and_validates(tmp_path):
    init_checkpoint("tiny", tmp_path / "ck", seed=1, tokenizer="bpe")
    report = validate_checkpoint(tmp_path / "ck")
    bundled = load_tokenizer(BUNDLED_K3_BPE)
    config = K3Config.from_json_file(tmp_path / "ck" / "config.json")
    assert (config.vocab_size, config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        bundled.vocab_size, bundled.bos_id, bundled.eos_id, bundled.pad_id)
    assert report["tokenizer"]["vocab_size"] == bundled.vocab_size and report["tokenizer"]["chat_template"]
    assert {"tiktoken.model", "tokenizer_config.json"} <= set(report["files"])  # hashed, in the manifest
    assert load_tokenizer(tmp_path / "ck", config).encode(TEXT) == bundled.encode(TEXT)


def test_a_tokenizer_larger_than_the_model_fails_validation(tmp_path):
    init_checkpoint("tiny", tmp_path / "ck", seed=1)  # the byte vocabulary: 260 ids
    assert validate_checkpoint(tmp_path / "ck")["tokenizer"] is None
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copyfile(BUNDLED_K3_BPE / name, tmp_path / "ck" / name)
    with pytest.raises(CheckpointValidationError, match=r"tokenizer.* ids but config.json.s vocab_size is 260.*bos at id 2048"):
        validate_checkpoint(tmp_path / "ck")


def test_a_preset_checks_the_architecture_and_the_tokenizer_sizes_the_vocabulary(tmp_path):
    """`k3rl run --preset tiny` on a tiny checkpoint with the BPE passes (its vocabulary is the
    tokenizer's, not the byte preset's 260), and a checkpoint of another architecture still fails."""
    init_checkpoint("tiny", tmp_path / "ck", seed=1, tokenizer="bpe")
    report = validate_checkpoint(tmp_path / "ck", config=K3Config.preset("tiny"))
    assert report["tokenizer"]["vocab_size"] == load_tokenizer(BUNDLED_K3_BPE).vocab_size
    with pytest.raises(CheckpointValidationError, match="does not describe the expected model"):
        validate_checkpoint(tmp_path / "ck", config=K3Config.preset("small"))
    (tmp_path / "ck" / "tiktoken.model").unlink()
    (tmp_path / "ck" / "tokenizer.json").unlink()  # no tokenizer left: the preset's byte vocabulary applies
    with pytest.raises(CheckpointValidationError, match="bos_token_id is 2048, expected 256"):
        validate_checkpoint(tmp_path / "ck", config=K3Config.preset("tiny"))
