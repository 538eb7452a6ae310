"""rewriter/ids_json.py: the text is always exactly the JSON of the ids given."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from rewriter.ids_json import IdsJson, ids_json

ids_lists = st.lists(st.integers(min_value=0, max_value=200_000), max_size=40)


def _earlier(ids: list[int]) -> IdsJson:
    return IdsJson(ids, ids_json(ids))


@given(ids_lists, ids_lists)
def test_an_extension_formats_to_the_json_of_its_ids(head: list[int], tail: list[int]) -> None:
    text = ids_json(head + tail, _earlier(head))
    assert json.loads(text) == head + tail
    assert text == json.dumps(head + tail, separators=(",", ":"))


@given(ids_lists, ids_lists)
def test_any_other_prompt_is_formatted_whole(earlier: list[int], ids: list[int]) -> None:
    assert ids_json(ids, _earlier(earlier)) == json.dumps(ids, separators=(",", ":"))


def test_a_changed_history_is_not_taken_for_an_extension() -> None:
    earlier = _earlier([1, 2, 3])
    assert json.loads(ids_json([1, 9, 3, 4], earlier)) == [1, 9, 3, 4]  # one id differs
    assert json.loads(ids_json([1, 2], earlier)) == [1, 2]  # shorter
    assert ids_json([1, 2, 3], earlier) is earlier.text  # the same prompt: the same text
    assert ids_json([], _earlier([])) == "[]" and ids_json([5], _earlier([])) == "[5]"


@given(st.lists(st.integers(), max_size=40))
def test_any_integers_are_formatted_as_pythons_json_does(ids: list[int]) -> None:
    """orjson writes the common case; integers past 64 bits fall back to Python's json."""
    assert ids_json(ids) == json.dumps(ids, separators=(",", ":"))
