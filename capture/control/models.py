"""The pydantic models of the control API's request bodies (``POST /sessions`` here; ``POST
/rollouts`` is capture/rollouts/spec.py's), and ``read_body``, which turns pydantic's first error
into the words a caller has always been given: the field, and what it must be.

The models are the bodies' one description: capture/control/openapi.py serves their
``model_json_schema()``. Fields are strict (``"n": "3"`` or ``"n": true`` is refused, not
coerced), and pydantic reports errors in the fields' order, which is the order they have always
been checked in, so a body with two mistakes is told of the same one as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from capture.control.sessions import (
    SESSION_ID,
    Limits,
    check_metadata,
    check_session_id,
    reject_unknown,
)

# What a caller is told when a field fails pydantic's own checks (its type, a bound): the
# words, or a function of the value given.
Words = str | Callable[[Any], str]
NOT_AN_OBJECT = "the body must be a JSON object"
# A session id in a schema: the same rule as SESSION_ID, anchored (JSON Schema searches).
ID_PATTERN = f"^{SESSION_ID.pattern}$"


def read_body[M: BaseModel](model: type[M], body: Any, words: Mapping[str, Words]) -> M:
    """``body`` (a request's parsed JSON) as ``model``; else a ValueError worded for the
    caller: a validator's own words, or ``words`` of the field (dotted: ``limits.max_calls``)
    pydantic refused."""
    if not isinstance(body, dict):
        raise ValueError(NOT_AN_OBJECT)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ValueError(explain(exc.errors()[0], words)) from None


def explain(error: ErrorDetails, words: Mapping[str, Words]) -> str:
    """One pydantic error in the caller's words (see ``read_body``)."""
    if error["type"] in ("value_error", "assertion_error"):
        return str((error.get("ctx") or {}).get("error", error["msg"]))
    loc = [str(part) for part in error["loc"]]
    # The longest part of the path with words: a union's member (``sandbox.literal[...]``)
    # is its field's.
    for end in range(len(loc), 0, -1):
        said = words.get(".".join(loc[:end]))
        if said is not None:
            return said(error.get("input")) if callable(said) else said
    return f'"{".".join(loc)}": {error["msg"]}'  # a field with no words: pydantic's, named


class SessionLimits(BaseModel):
    """A session's limits: past any of them its next call is refused, and the limit is its
    ``end_reason``."""

    model_config = ConfigDict(extra="forbid")

    max_calls: Annotated[StrictInt, Field(ge=1, description="model calls")] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, description="sampled tokens")] | None = None
    deadline_s: (
        Annotated[
            StrictFloat,
            Field(gt=0, allow_inf_nan=False, description="seconds after the session opens"),
        ]
        | None
    ) = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        if isinstance(value, dict):
            reject_unknown(value, tuple(cls.model_fields), "limit")
        return value

    def limits(self) -> Limits:
        deadline = float(self.deadline_s) if self.deadline_s is not None else None
        return Limits(self.max_calls, self.max_tokens, deadline)


LIMITS_WORDS: dict[str, Words] = {
    "limits": '"limits" must be an object: {"max_calls", "max_tokens", "deadline_s"}',
    "limits.max_calls": lambda v: (
        f'"limits.max_calls" must be a whole number of at least 1, not {v!r}'
    ),
    "limits.max_tokens": lambda v: (
        f'"limits.max_tokens" must be a whole number of at least 1, not {v!r}'
    ),
    "limits.deadline_s": lambda v: (
        f'"limits.deadline_s" must be a number of seconds > 0, not {v!r}'
    ),
}


class SessionFields(BaseModel):
    """What a body that opens a session checks the same way, whichever route it came by: its
    ``id`` and its ``metadata`` (the fields themselves are declared where they stand in the
    body's order)."""

    @field_validator("id", mode="before", check_fields=False)
    @classmethod
    def _id(cls, value: Any) -> Any:
        return check_session_id(value) if value is not None else None

    @field_validator("metadata", mode="before", check_fields=False)
    @classmethod
    def _metadata(cls, value: Any) -> dict[str, Any]:
        return check_metadata(value)


class SessionBody(SessionFields):
    """``POST /sessions``: a session opened with its id (else a new one), metadata and
    limits."""

    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, Field(pattern=ID_PATTERN, description="else one is made")] | None = None
    metadata: Annotated[
        dict[str, Any],
        Field(description='written on every row, e.g. {"task_id": "t1", "split": "train"}'),
    ] = {}
    limits: SessionLimits | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        if isinstance(value, dict):
            reject_unknown(value, tuple(cls.model_fields))
        return value

    def session_limits(self) -> Limits:
        return self.limits.limits() if self.limits is not None else Limits()


def read_session(body: Any) -> SessionBody:
    """A ``POST /sessions`` body; a ValueError worded for the caller otherwise."""
    return read_body(SessionBody, body, LIMITS_WORDS)
