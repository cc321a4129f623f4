"""Byte-level tokenizer for the CPU presets (``tiny``, ``small``): one token per UTF-8 byte, then the
special tokens ``bos``, ``eos``, ``pad`` at the ids the config names. The release's 163,840-token
tokenizer is not reproduced here; larger presets take token ids from the caller.
"""

from __future__ import annotations

from k3core.config import K3Config


class ByteTokenizer:
    def __init__(self, config: K3Config):
        if config.vocab_size < 256 + 3:
            raise ValueError(f"a byte-level vocabulary needs vocab_size >= 259, got {config.vocab_size}")
        self.vocab_size = config.vocab_size
        self.bos_id, self.eos_id, self.pad_id = config.bos_token_id, config.eos_token_id, config.pad_token_id
        if min(self.bos_id, self.eos_id, self.pad_id) < 256:
            raise ValueError("byte-level presets put bos/eos/pad at ids >= 256 (ids 0-255 are bytes)")

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id] + ids if bos else ids

    def decode(self, ids: list[int]) -> str:
        """Bytes only; special tokens are dropped; invalid UTF-8 is replaced, never raised."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
