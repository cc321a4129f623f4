"""Tokenizers of k3core: a checkpoint's own tokenizer, read from its data files, never its code.

Owns: ``load_tokenizer`` (which format a checkpoint directory holds), the ``Tokenizer`` protocol
every format meets, and ``check_against_config`` (a tokenizer fits a model config). Does not own:
the formats themselves (``tiktoken_bpe.py``, ``hf.py``, ``byte.py``), chat rendering (``chat.py``),
tool-call text (``tool_calls.py``), or building the bundled BPE (``build_bpe.py``).

A checkpoint may ship ``tokenization_*.py`` and name it in ``tokenizer_config.json``'s ``auto_map``
(the release does): that code is never imported. Only ``tiktoken.model``, ``tokenizer.json``,
``tokenizer_config.json`` and ``chat_template.jinja`` are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from k3core.config import K3Config
from k3core.tokenizer.byte import ByteTokenizer, is_byte_vocabulary
from k3core.tokenizer.chat import ChatTemplateError
from k3core.tokenizer.files import CONFIG_FILE, HF_TOKENIZER_FILE, TIKTOKEN_FILE
from k3core.tokenizer.hf import HFTokenizer
from k3core.tokenizer.tiktoken_bpe import TiktokenTokenizer

__all__ = ["BUNDLED_K3_BPE", "ByteTokenizer", "ChatTemplateError", "HFTokenizer", "TiktokenTokenizer", "Tokenizer",
           "check_against_config", "load_tokenizer"]

# a ~2k-token byte-level BPE in the release's layout (k3core/tokenizer/build_bpe.py makes it)
BUNDLED_K3_BPE = Path(__file__).resolve().parent / "bundled" / "k3-bpe"


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int  # ids it can produce: base + special
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]  # ids that end an assistant turn: eos, and <|im_end|> where present
    special_ids: dict[str, int]
    chat_template: str | None

    def encode(self, text: str, bos: bool = False) -> list[int]: ...

    def decode(self, ids, skip_special_tokens: bool = False) -> str: ...

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> list[int]: ...


def _config_ids(config: K3Config | None):
    return (None, None, None) if config is None else (config.bos_token_id, config.eos_token_id, config.pad_token_id)


def load_tokenizer(path: str | Path, config: K3Config | None = None) -> Tokenizer:
    """The tokenizer of checkpoint directory ``path``: ``tiktoken.model`` (the release's format), else
    ``tokenizer.json``, else, for a config with a byte vocabulary (tiny/small), ``ByteTokenizer``.
    ``config`` fills bos/eos/pad that ``tokenizer_config.json`` does not name, and bounds the
    release's trailing reserved ids (see ``TiktokenTokenizer``)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"tokenizer directory {directory} does not exist (or is not a directory)")
    if (directory / TIKTOKEN_FILE).is_file():
        return TiktokenTokenizer(directory, _config_ids(config), None if config is None else config.vocab_size)
    if (directory / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer(directory, _config_ids(config))
    if config is not None and is_byte_vocabulary(config):
        return ByteTokenizer(config)
    why = ("no model config was given" if config is None else
           f"its config's vocabulary ({config.vocab_size:,} ids, bos/eos/pad {config.bos_token_id}/"
           f"{config.eos_token_id}/{config.pad_token_id}) is not a byte vocabulary")
    raise ValueError(f"no tokenizer in {directory}: looked for {TIKTOKEN_FILE} (+ {CONFIG_FILE}) and "
                     f"{HF_TOKENIZER_FILE}, and {why}. Fix: `k3rl checkpoint init --tokenizer ...`, or copy the "
                     f"release's {TIKTOKEN_FILE} and {CONFIG_FILE} into {directory}")


def _source_name(tok: Tokenizer) -> str:
    return {TiktokenTokenizer: TIKTOKEN_FILE, HFTokenizer: HF_TOKENIZER_FILE}.get(type(tok), "the byte tokenizer")


def check_against_config(tok: Tokenizer, config: K3Config) -> None:
    """Raise ValueError unless every id ``tok`` produces has an embedding row in ``config``'s model and
    the config's bos/eos/pad are the tokenizer's. Every disagreement is reported at once."""
    source, problems = _source_name(tok), []
    if tok.vocab_size > config.vocab_size:
        problems.append(f"{source} gives {tok.vocab_size:,} ids but config.json's vocab_size is "
                        f"{config.vocab_size:,}: the model has no embedding row for ids {config.vocab_size:,} and up")
    for kind in ("bos", "eos", "pad"):
        mine, theirs = getattr(tok, f"{kind}_id"), getattr(config, f"{kind}_token_id")
        if mine is not None and mine != theirs:
            problems.append(f"{source} puts {kind} at id {mine} but config.json's {kind}_token_id is {theirs}")
    if problems:
        raise ValueError("tokenizer and model config disagree: " + "; ".join(problems) + ". Fix: use the "
                         "tokenizer files the checkpoint was trained with, or correct config.json")
