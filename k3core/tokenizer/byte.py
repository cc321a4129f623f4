"""Byte-level tokenizer for the CPU presets (``tiny``, ``small``): one token per UTF-8 byte, then the
special tokens ``bos``, ``eos``, ``pad`` at the ids the config names.

Owns: the byte vocabulary. Does not own: BPE vocabularies (``tiktoken_bpe.py``, ``hf.py``).

Two behaviours stay as they were before the ``Tokenizer`` protocol, because about fifteen call sites
rely on them: ``encode`` prepends bos by default, and ``decode`` drops every id that is not a byte
(bos/eos/pad and the unused ids a sampled completion may hold), whatever ``skip_special_tokens``
says. Ids outside ``[0, vocab_size)`` raise: no model of this vocabulary produces them.
"""

from __future__ import annotations

from k3core.config import K3Config
from k3core.tokenizer.chat import ChatMixin
from k3core.tokenizer.specials import NUM_SPECIAL


def is_byte_vocabulary(config: K3Config) -> bool:
    """A config a ``ByteTokenizer`` serves: room for 256 bytes + 3 specials, specials above the bytes,
    and no more ids than bytes + ``NUM_SPECIAL``. The bound matters: the release's config
    (163,840 ids, specials at 163,584+) passes the first two tests, and a checkpoint of it without
    tokenizer files must fail, not decode BPE ids as bytes."""
    return (256 + 3 <= config.vocab_size <= 256 + NUM_SPECIAL
            and min(config.bos_token_id, config.eos_token_id, config.pad_token_id) >= 256)


class ByteTokenizer(ChatMixin):
    def __init__(self, config: K3Config, chat_template: str | None = None):
        if config.vocab_size < 256 + 3:
            raise ValueError(f"a byte-level vocabulary needs vocab_size >= 259, got {config.vocab_size}")
        self.vocab_size = config.vocab_size
        self.bos_id, self.eos_id, self.pad_id = config.bos_token_id, config.eos_token_id, config.pad_token_id
        if min(self.bos_id, self.eos_id, self.pad_id) < 256:
            raise ValueError("byte-level presets put bos/eos/pad at ids >= 256 (ids 0-255 are bytes)")
        self.stop_ids: tuple[int, ...] = (self.eos_id,)
        self.special_ids: dict[str, int] = {"[BOS]": self.bos_id, "[EOS]": self.eos_id, "[PAD]": self.pad_id}
        self.chat_template = chat_template

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """UTF-8 bytes; special-token strings are plain text here (the byte vocabulary has no names)."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id] + ids if bos else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Bytes only; special tokens are dropped; invalid UTF-8 is replaced, never raised."""
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the byte tokenizer's vocabulary of {self.vocab_size} ids")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def _template(self) -> str:
        if self.chat_template is None:
            raise ValueError("the byte tokenizer has no chat template (the tiny/small presets train on raw "
                             "prompts); pass ByteTokenizer(config, chat_template=...) or encode the text yourself")
        return self.chat_template
