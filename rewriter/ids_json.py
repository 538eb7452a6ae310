"""A prompt's token ids as JSON text, built from the session's previous prompt's text.

An agent's next prompt nearly always starts with its previous one: formatting only the new ids
makes the request body of a 20,000-token prompt cost tens of microseconds instead of a
millisecond or more on the event loop (``json.dumps`` formats every id every call). Pure: no
I/O, no HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class IdsJson:
    """Token ids and their JSON text (a list, no spaces). ``ids`` is never changed after."""

    ids: list[int]
    text: str


def ids_json(ids: list[int], earlier: IdsJson | None = None) -> str:
    """The JSON text of ``ids``, reusing ``earlier.text`` where ``ids`` starts with
    ``earlier.ids`` (compared whole: nothing is assumed)."""
    if earlier is not None:
        n = len(earlier.ids)
        if n <= len(ids) and ids[:n] == earlier.ids:
            if n == len(ids):
                return earlier.text
            tail = ",".join(map(str, ids[n:]))
            return f"{earlier.text[:-1]}{',' if n else ''}{tail}]"
    try:
        # A whole prompt (a new thread): orjson writes a list of ints as json.dumps does,
        # ten times as fast (a 20,000-id prompt: about 0.1 ms instead of 1 ms on the loop).
        return orjson.dumps(ids).decode()
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(ids, separators=(",", ":"))  # past 64 bits: only Python's writes it
