"""Ids this proxy mints for responses and their output items, and reading them back: an item a
client sends again names the response (the policy call) it came from."""

from __future__ import annotations

import re
import secrets
from typing import Any


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def new_item_id(prefix: str, response_id: str) -> str:
    """An output item's id: its response's token, then a random part. An item the client sends
    back therefore names the response (the policy call) it came from: :func:`origin_response`."""
    return f"{prefix}_{response_id.removeprefix('resp_')}{secrets.token_hex(4)}"


_MINTED_ITEM = re.compile(r"(?:rs|msg|fc|ctc)_([0-9a-f]{48})[0-9a-f]{8}")


def origin_response(item: dict[str, Any]) -> str | None:
    """The id of the response this proxy answered with ``item`` in, if it did."""
    value = item.get("id")
    if isinstance(value, str):
        found = _MINTED_ITEM.fullmatch(value)
        if found:
            return "resp_" + found.group(1)
    return None
