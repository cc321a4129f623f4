"""The typed fields of the rollout server's request models, shared by ``/generate``
(``k3core.rollout.server``) and ``/v1/chat/completions`` (``k3core.rollout.chat_completions``):
each says what it may hold (its ``description``, which a refusal quotes), and pydantic checks it.
Also ``BadRequest`` (a refused request) and ``register_nested`` (which item model a list field
holds, so that a refusal names the item's own field)."""

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, StrictBool

__all__ = ["TOP_K_ALL", "BadRequest", "register_nested"]


class BadRequest(ValueError):
    """A request the server refuses as malformed (HTTP 400, or ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# Every field of a request is declared once below, with what it may hold; pydantic checks it
# (strict: "3" is not a number, 0 is not a switch, NaN and inf are not finite) and
# ``_refusal`` turns its errors into one sentence per field: the field, what is allowed, what came.
# A field's ``description`` is that "what is allowed"; ``{max_new_tokens}`` and ``{vocab_size}`` in
# it are this server's limits, passed as the validation context.
def _integral(v):
    """An integral float (4.0, 1e30) reads as the integer it is; anything else is left to the strict check."""
    return int(v) if isinstance(v, float) and math.isfinite(v) and v.is_integer() else v


def _int(lo: int, hi: int, why: str = ""):
    return Annotated[Annotated[int, BeforeValidator(_integral), Field(strict=True, ge=lo, le=hi)] | None,
                     Field(description=f"an integer in [{lo}, {hi}]{why}")]


def _float(lo: float, hi: float, lo_open: bool = False):
    bound = {"gt": lo} if lo_open else {"ge": lo}
    return Annotated[Annotated[float, Field(strict=True, allow_inf_nan=False, le=hi, **bound)] | None,
                     Field(description=f"a finite number in {'(' if lo_open else '['}{float(lo)}, {float(hi)}]")]


def _neutral(value):
    def only(v):
        if v is not None and v != value:
            raise ValueError("unsupported value")
        return v

    return Annotated[Any, AfterValidator(only), Field(description=f"{value} (the only value this server supports)")]


def _switch(what: str = "true or false"):
    return Annotated[StrictBool | None, Field(description=what)]


TOP_K_ALL = 1 << 30  # SGLang's "no top-k" value; anything from the vocabulary size up means the same
_StopString = Annotated[str, Field(strict=True, min_length=1, max_length=1024)]
_Ids = Annotated[list[Annotated[int, Field(strict=True)]], Field(min_length=1)]



_NESTED: dict[tuple[type, str], type] = {}  # (request model, field) -> the model its items are


def register_nested(model: type[BaseModel], field: str, item: type[BaseModel]) -> None:
    """Say that ``model.field`` holds ``item`` models (or a list of them): a refusal then names the
    item's own field (``messages[2].role``) instead of showing the whole list."""
    _NESTED[(model, field)] = item
