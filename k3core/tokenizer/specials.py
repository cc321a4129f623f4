"""K3's special tokens: where they sit after the base vocabulary, and the names of the unnamed ones.

Owns: the release's layout of special ids (``n_base + offset``) and the reserved-name rule. Does not
own: reading names from a checkpoint (``files.py``) or encoding (the tokenizer classes).

The release's tokenizer gives ``NUM_SPECIAL = 256 + 2`` ids after the base vocabulary, named from
``added_tokens_decoder`` in ``tokenizer_config.json``; an id without a name there is
``<|reserved_token_{id}|>``.
"""

from __future__ import annotations

NUM_SPECIAL = 256 + 2

# offset from n_base -> name, in the release's order (the gaps are reserved ids)
K3_SPECIAL_OFFSETS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}

# the token that ends an assistant turn besides eos, where the vocabulary has it
TURN_END = "<|im_end|>"


def reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def special_names(n_base: int, named: dict[int, str], count: int = NUM_SPECIAL) -> dict[str, int]:
    """name -> id for ids ``n_base .. n_base + count - 1``: the name ``named`` gives, else reserved."""
    return {named.get(i, reserved_name(i)): i for i in range(n_base, n_base + count)}
