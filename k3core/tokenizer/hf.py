"""The ``tokenizers`` format: ``tokenizer.json`` (+ ``tokenizer_config.json``), run by the
``tokenizers`` library (Rust), never by transformers' Python tokenizer classes.

Owns: the ``Tokenizer`` protocol over a ``tokenizers.Tokenizer``. Special ids are the added tokens
``tokenizer.json`` marks special; bos/eos/pad and the chat template come from
``tokenizer_config.json``. Added-token strings in the text encode as their ids, as in tiktoken's
``allowed_special="all"``; the file's post-processor (a bos it would add) is not applied, ``bos=``
says that.

``tokenizers`` is imported here, when a checkpoint needs it, not with the package: k3rl's runtime
dependencies have tiktoken (the release's format) and the byte tokenizer needs neither.
"""

from __future__ import annotations

from pathlib import Path

from k3core.tokenizer.chat import ChatMixin
from k3core.tokenizer.files import HF_TOKENIZER_FILE, read_tokenizer_config
from k3core.tokenizer.specials import TURN_END
from k3core.tokenizer.tiktoken_bpe import special_token_ids, with_bos


class HFTokenizer(ChatMixin):
    def __init__(self, directory: str | Path, fallback_ids=(None, None, None)):
        directory = Path(directory)
        path = directory / HF_TOKENIZER_FILE
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError(f"{path} needs the `tokenizers` library: pip install tokenizers") from e
        try:
            self.backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type for a file it cannot read
            raise ValueError(f"{path}: the tokenizers library cannot read it ({e}); copy it again from the "
                             "release") from e
        self.backend.no_truncation()
        self.backend.no_padding()
        cfg = read_tokenizer_config(directory)
        vocab = self.backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self._has_holes = len(set(vocab.values())) != self.vocab_size
        self.special_ids = {t.content: i for i, t in sorted(self.backend.get_added_tokens_decoder().items())
                            if t.special}
        self.bos_id, self.eos_id, self.pad_id = special_token_ids(vocab, cfg, str(directory), fallback_ids)
        self.stop_ids = tuple(dict.fromkeys(i for i in (self.eos_id, vocab.get(TURN_END)) if i is not None))
        self.chat_template = cfg.chat_template

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return with_bos(self.backend.encode(text, add_special_tokens=False).ids, bos, self.bos_id)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size or (self._has_holes and self.backend.id_to_token(i) is None):
                raise ValueError(f"token id {i} is not in this tokenizer's vocabulary of {self.vocab_size:,} ids")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
