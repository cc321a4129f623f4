"""Rendering a checkpoint's chat template, in a jinja2 sandbox, the way transformers renders it.

Owns: the environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``) and the names a template sees, matched to transformers'
``chat_template_utils``: the ``tojson`` filter (``ensure_ascii=False`` and no HTML escaping),
``raise_exception``, ``strftime_now``, ``dict`` and an underscore-refusing ``namespace``; the
preparation of messages (plain JSON data, keys whose value is None dropped) and of tools (deep-sorted
by key, as the release's tokenizer does). Does not own: encoding the rendered text (the tokenizers).

A template is data from a checkpoint, so it never reaches Python: an attribute the sandbox deems
unsafe (``''.__class__``, ``cycler.__init__``) raises ``ChatTemplateError`` at once, where plain
jinja2 would render an empty string until the value is used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template that does not compile, refers to Python internals, or raises while rendering."""


class _RefusingSandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` that refuses underscore-prefixed names (no storing ``__class__``)."""

    def __init__(*args, **kwargs):  # jinja2's signature trick: a key named ``self`` stays possible
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace may not hold the underscore-prefixed name {name!r}")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = _RefusingSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} (template line {e.lineno}); fix "
                                "the template in tokenizer_config.json or chat_template.jinja") from e


def deep_sort(value):
    """Dicts rebuilt with their keys sorted, at every depth; lists keep their order."""
    if isinstance(value, Mapping):
        return {k: deep_sort(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [deep_sort(v) for v in value]
    return value


def _plain(value):
    """JSON-like data only: the template sees no object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, base):
            return base(value)
    raise TypeError(f"chat messages and tools must be JSON-like data (dict, list, str, numbers), got "
                    f"{type(value).__name__}")


def render(template: str, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = True, **kwargs) -> str:
    """The text ``template`` renders for ``messages`` (keys whose value is None dropped, as
    transformers does) and ``tools`` (deep-sorted by key)."""
    for m in messages:
        if not isinstance(m, Mapping):
            raise TypeError(f"a chat message must be a dict with 'role' and 'content', got {m!r}")
    chat = [{k: v for k, v in _plain(m).items() if v is not None} for m in messages]
    tools = None if tools is None else _plain(deep_sort(tools))
    compiled = compile_template(template)
    try:
        return compiled.render(messages=chat, tools=tools, add_generation_prompt=add_generation_prompt,
                               **_plain(kwargs))
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template tried to reach Python internals, which the jinja2 sandbox "
                                f"refuses: {e}. The template is not rendered; use a template that only reads "
                                "messages and tools") from e
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed while rendering: {e}") from e


class ChatMixin:
    """``render_chat`` and ``apply_chat_template`` for a tokenizer with ``chat_template`` and ``encode``."""

    chat_template: str | None

    def _template(self) -> str:
        if self.chat_template is None:
            raise ValueError(f"{type(self).__name__} has no chat template: the checkpoint's tokenizer_config.json "
                             "has no 'chat_template' and there is no chat_template.jinja; add one, or encode "
                             "the prompt text yourself")
        return self.chat_template

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        return render(self._template(), messages, tools, add_generation_prompt)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """The ids of ``render_chat(...)``: special-token strings the template writes encode as their ids."""
        return self.encode(self.render_chat(messages, tools, add_generation_prompt))
