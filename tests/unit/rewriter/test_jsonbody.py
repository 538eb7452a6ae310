"""rewriter/jsonbody.py: the strict reader's depth limit, walked the fast way (containers only)
when the text holds no surrogate escape, the full way when it does."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewriter.jsonbody import MAX_DEPTH, JSONBodyError, loads


def _nested(depth: int, path: list[bool]) -> Any:
    """``depth`` containers inside each other, lists or objects as ``path`` says."""
    value: Any = "leaf"
    for i in range(depth):
        value = {"k": value, "n": [1, 2.5]} if path[i % len(path)] else [value, {}, []]
    return value


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(MAX_DEPTH - 3, MAX_DEPTH + 3),
    path=st.lists(st.booleans(), min_size=1, max_size=5),
    lone_surrogate=st.booleans(),
    width=st.integers(0, 150),
)
def test_refused_exactly_past_the_depth_limit(
    depth: int, path: list[bool], lone_surrogate: bool, width: int
) -> None:
    # Siblings make the text's brackets many (every agent request has them) at little depth.
    value = {"wide": [[i] for i in range(width)], "deep": _nested(depth, path)}
    text = json.dumps(value)
    if lone_surrogate:  # an escaped surrogate pair: text, and the full walk runs
        text = text.replace('"leaf"', '"\\ud83d\\ude00"')
    if _depth(json.loads(text)) > MAX_DEPTH:
        with pytest.raises(JSONBodyError, match=f"deeper than {MAX_DEPTH} levels"):
            loads(text.encode())
    else:
        assert loads(text.encode()) == json.loads(text)


def test_a_lone_surrogate_is_still_refused_in_a_wide_body() -> None:
    text = json.dumps({"tools": [[i] for i in range(200)], "t": "x"}).replace('"x"', '"\\ud800"')
    with pytest.raises(JSONBodyError, match="lone UTF-16 surrogate"):
        loads(text)


@pytest.mark.parametrize("text", ["1", "null", '"text"', "[]", "{}", "2.5", "true"])
def test_any_json_value_reads(text: str) -> None:
    assert loads(text) == json.loads(text)
