"""The pre-tokenization regex of Kimi's tiktoken tokenizers (``pat_str``), kept as its pieces.

Owns: the exact pattern text, in the release's order. Does not own: how it is compiled. tiktoken
(Rust ``fancy-regex``) and ``tokenizers`` (Oniguruma) both accept it as written, class
intersections ``[...&&[^\\p{Han}]]`` included; Python's ``regex`` module needs ``regex.V1`` for
the intersections (``kimi_split`` below, the reference the tests use).
"""

from __future__ import annotations

KIMI_PAT_PIECES: tuple[str, ...] = (
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
)
KIMI_PAT_STR = "|".join(KIMI_PAT_PIECES)


def kimi_split(text: str) -> list[str]:
    """The pieces ``KIMI_PAT_STR`` cuts ``text`` into, by Python's ``regex`` (``V1``: set operations).
    A reference for the two compiled engines, not a fast path."""
    import regex

    return regex.findall(KIMI_PAT_STR, text, flags=regex.V1)
