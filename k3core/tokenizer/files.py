"""Reading a checkpoint's tokenizer data files: ``tiktoken.model``, ``tokenizer_config.json`` and
``chat_template.jinja``.

Owns: parsing those files into plain values, with errors that name the file (and line) at fault.
Does not own: building an encoder from them (``tiktoken_bpe.py``, ``hf.py``).

Only data is read. A ``tokenizer_config.json`` whose ``auto_map`` names a ``tokenization_*.py``
module, and that module itself, are ignored: nothing from a checkpoint is imported or executed.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from pathlib import Path

TIKTOKEN_FILE = "tiktoken.model"
HF_TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class TokenizerConfigFile:
    """What ``tokenizer_config.json`` (and ``chat_template.jinja``) say; every field may be absent."""

    path: Path | None = None
    added_tokens: dict[int, str] = field(default_factory=dict)  # id -> content
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """``base64(token bytes) rank`` per line -> {token bytes: rank}. The ranks must be exactly
    ``0 .. n-1`` (they are the base token ids, and the special ids start at ``n``)."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError(f"expected 2 fields, got {len(parts)}")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{path}, line {lineno}: not a 'base64-token rank' line ({e}): {line[:80]!r}. The file "
                             "is corrupt or not a tiktoken BPE file; copy it again from the release") from e
        if token in ranks:
            raise ValueError(f"{path}, line {lineno}: token {token!r} appears twice (ranks {ranks[token]} and {rank})")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not exactly 0..{len(ranks) - 1} (the base ids must be contiguous so the "
                         "special ids can follow them)")
    return ranks


def _token_content(value, where: str) -> str | None:
    """A token entry is a string or a dict with ``content`` (transformers' AddedToken as JSON)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a string or an object with 'content', got {value!r}")


def _template_from_config(value, where: str) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` of which "default" is taken."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{where}: chat_template is a list without a template named 'default' (names: "
                         f"{sorted(str(n) for n in named)})")
    raise ValueError(f"{where}: chat_template must be a string or a list of named templates, got {type(value).__name__}")


def read_tokenizer_config(directory: Path) -> TokenizerConfigFile:
    """Read ``tokenizer_config.json`` and ``chat_template.jinja`` of ``directory`` (either may be
    missing). ``chat_template.jinja`` wins over the config's ``chat_template`` when both exist, as in
    transformers: the file is what newer releases edit."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    raw: dict = {}
    if path.is_file():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); copy it again from the release") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    added: dict[int, str] = {}
    for key, entry in (raw.get("added_tokens_decoder") or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"{path}: added_tokens_decoder key {key!r} is not a token id") from None
        content = _token_content(entry, f"{path}: added_tokens_decoder[{key!r}]")
        if content is not None:
            added[token_id] = content
    template_file = directory / TEMPLATE_FILE
    template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                else _template_from_config(raw.get("chat_template"), str(path)))
    return TokenizerConfigFile(
        path=path if path.is_file() else None,
        added_tokens=added,
        bos_token=_token_content(raw.get("bos_token"), f"{path}: bos_token"),
        eos_token=_token_content(raw.get("eos_token"), f"{path}: eos_token"),
        pad_token=_token_content(raw.get("pad_token"), f"{path}: pad_token"),
        chat_template=template,
    )
