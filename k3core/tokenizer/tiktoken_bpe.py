"""The release's tokenizer format: ``tiktoken.model`` + ``tokenizer_config.json``, run by tiktoken.

Owns: building a ``tiktoken.Encoding`` from those files exactly as the release's own tokenizer does
(base ranks from the file, ``NUM_SPECIAL`` special ids right after them, Kimi's ``pat_str``), and
the ``Tokenizer`` protocol over it. Does not own: parsing the files (``files.py``).

``encode`` treats every special-token string in the text as its id (tiktoken's
``allowed_special="all"``): chat templates write ``<|im_end|>`` as text and mean the token.
"""

from __future__ import annotations

from pathlib import Path

import tiktoken

from k3core.tokenizer.chat import ChatMixin
from k3core.tokenizer.files import TIKTOKEN_FILE, TokenizerConfigFile, read_tiktoken_ranks, read_tokenizer_config
from k3core.tokenizer.pattern import KIMI_PAT_STR
from k3core.tokenizer.specials import NUM_SPECIAL, TURN_END, reserved_name, special_names


def with_bos(ids: list[int], bos: bool, bos_id: int | None) -> list[int]:
    """``ids``, after ``bos_id`` when ``bos`` (a tokenizer without a bos token refuses ``bos=True``)."""
    if not bos:
        return ids
    if bos_id is None:
        raise ValueError("encode(bos=True): this tokenizer has no bos_token")
    return [bos_id, *ids]


def special_token_ids(names: dict[str, int], cfg: TokenizerConfigFile, source: str,
                      fallback: tuple[int | None, int | None, int | None] = (None, None, None)):
    """(bos, eos, pad) ids: the config's token names looked up in ``names``; a name missing from the
    config falls back to ``fallback`` (the model config's ids), pad last of all to eos."""
    def lookup(kind: str, name: str | None, default: int | None) -> int | None:
        if name is None:
            return default
        if name not in names:
            raise ValueError(f"{source}: {kind}_token {name!r} is not a token of this vocabulary; fix "
                             f"{kind}_token in tokenizer_config.json")
        return names[name]

    bos = lookup("bos", cfg.bos_token, fallback[0])
    eos = lookup("eos", cfg.eos_token, fallback[1])
    if eos is None:
        raise ValueError(f"{source}: no eos_token (tokenizer_config.json names none and no model config was "
                         "given); add eos_token to tokenizer_config.json")
    pad = lookup("pad", cfg.pad_token, fallback[2])
    return bos, eos, eos if pad is None else pad


class TiktokenTokenizer(ChatMixin):
    """``directory/tiktoken.model`` + ``tokenizer_config.json``. ``max_vocab`` (the model's
    vocab_size, where known) drops trailing reserved ids (unnamed, or named ``<|reserved_token_N|>``)
    the embedding has no row for: the release's rule gives ``n_base + 258`` ids where its config
    gives ``n_base + 256``. A named token past ``max_vocab`` is kept, and ``check_against_config``
    reports it."""

    def __init__(self, directory: str | Path, fallback_ids=(None, None, None), max_vocab: int | None = None):
        directory = Path(directory)
        ranks = read_tiktoken_ranks(directory / TIKTOKEN_FILE)
        cfg = read_tokenizer_config(directory)
        self.n_base = len(ranks)
        count = NUM_SPECIAL
        if max_vocab is not None and self.n_base + count > max_vocab:
            named_end = max((i + 1 for i, name in cfg.added_tokens.items()
                             if i >= self.n_base and name != reserved_name(i)), default=self.n_base)
            count = max(max_vocab, named_end) - self.n_base
        self.special_ids = special_names(self.n_base, cfg.added_tokens, count)
        self.vocab_size = self.n_base + count
        self.encoding = tiktoken.Encoding(name=str(directory / TIKTOKEN_FILE), pat_str=KIMI_PAT_STR,
                                          mergeable_ranks=ranks, special_tokens=self.special_ids)
        self.bos_id, self.eos_id, self.pad_id = special_token_ids(self.special_ids, cfg, str(directory), fallback_ids)
        self.stop_ids = tuple(dict.fromkeys(i for i in (self.eos_id, self.special_ids.get(TURN_END)) if i is not None))
        self.chat_template = cfg.chat_template

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return with_bos(self.encoding.encode(text, allowed_special="all"), bos, self.bos_id)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside this tokenizer's vocabulary of {self.vocab_size:,} ids")
        if skip_special_tokens:
            ids = [i for i in ids if i < self.n_base]
        return self.encoding.decode_bytes(ids).decode("utf-8", errors="replace")
