"""How an environment's prompt becomes the token ids the engine samples from, and how sampled ids
become the text a reward reads: raw text, or a chat conversation in the checkpoint's own template.

Owns: ``PromptFormat`` (a run's tokenizer and whether prompts are chat-formatted), the messages an
environment's prompt makes (``env_messages``), and the formats a run may ask for (``PROMPT_FORMATS``).
Does not own: the tokenizers (``k3core.tokenizer``), sampling (``k3core.rollout``), rewards.

- ``chat``: the prompt is a conversation, ``[system?, user]``, rendered with the tokenizer's chat
  template and its generation prompt; a completion ends at any of the tokenizer's stop ids (``[EOS]``,
  ``<|im_end|>``), and a reference answer is taught ending with the end-of-turn token.
- ``raw``: the prompt text itself, after ``bos``; a completion ends at ``eos``.
- ``auto``: ``chat`` where the tokenizer has a chat template (a checkpoint with its own tokenizer),
  else ``raw`` (the byte presets).

An environment shapes its conversation with two optional attributes: ``system_prompt`` (a string:
the system turn; without it the template's default applies) and ``messages(prompt)`` (the whole
list of turns, for environments that need more than one user turn). The reward always receives the
environment's own prompt string and the decoded completion, whatever the format.

The ids are what the engine saw and produced: rollout tables store them and the trainer trains on
them (``k3core.rl.train``), never on text re-encoded from a decoded completion.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3core.settings import PROMPT_FORMATS

__all__ = ["PROMPT_FORMATS", "PromptFormat", "env_messages"]


def env_messages(env, prompt: str) -> list[dict]:
    """The conversation ``prompt`` stands for: ``env.messages(prompt)`` where the environment defines
    it, else its ``system_prompt`` (if any) and one user turn holding the prompt."""
    custom = getattr(env, "messages", None)
    if callable(custom):
        turns = custom(prompt)
        if not isinstance(turns, list) or not all(isinstance(t, dict) and "role" in t for t in turns):
            raise ValueError(f"environment {getattr(env, 'name', type(env).__name__)!r}: messages(prompt) must return "
                             f"a list of {{'role': ..., 'content': ...}} dicts, got {turns!r:.200}")
        return turns
    system = getattr(env, "system_prompt", None)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


@dataclass(frozen=True)
class PromptFormat:
    """A run's tokenizer (``k3core.tokenizer.Tokenizer``) and how its prompts are written (``chat``)."""

    tok: object
    chat: bool
    env: object = None  # the environment whose ``system_prompt`` / ``messages`` shape a chat prompt

    @classmethod
    def of(cls, tok, env=None, mode: str = "auto") -> PromptFormat:
        """``mode`` one of ``PROMPT_FORMATS``; ``chat`` with a tokenizer that has no template is refused."""
        if mode not in PROMPT_FORMATS:
            raise ValueError(f"prompt format {mode!r}: use one of {', '.join(PROMPT_FORMATS)}")
        has_template = getattr(tok, "chat_template", None) is not None
        if mode == "chat" and not has_template:
            raise ValueError(f"--prompt-format chat: the run's tokenizer ({type(tok).__name__}) has no chat template; "
                             "use a checkpoint that carries one (`k3rl checkpoint init --tokenizer bpe`) or "
                             "--prompt-format raw")
        return cls(tok, has_template if mode == "auto" else mode == "chat", env)

    @property
    def pad_id(self) -> int:
        return self.tok.pad_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a completion: every end-of-turn id of a chat tokenizer, else ``eos``."""
        return tuple(self.tok.stop_ids) if self.chat else (self.tok.eos_id,)

    @property
    def end_id(self) -> int:
        """The id a taught answer ends with: ``<|im_end|>`` in a chat (its last stop id), else ``eos``."""
        return self.stop_ids[-1]

    def prompt_ids(self, prompt: str) -> list[int]:
        if self.chat:
            return self.tok.apply_chat_template(env_messages(self.env, prompt), add_generation_prompt=True)
        return self.tok.encode(prompt, bos=self.tok.bos_id is not None)

    def answer_ids(self, answer: str) -> list[int]:
        """A reference completion as the engine would sample it: its text, then the end token."""
        return self.tok.encode(answer, bos=False) + [self.end_id]

    def completion_text(self, output_ids) -> str:
        """The text of a completion for its reward: without the stop id that ended it, special tokens
        inside it kept as text (a tool-call section stays parseable)."""
        ids = list(output_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tok.decode(ids)
