"""A thread row's rules, read one way by the reader, the trainer adapters and the viewer: its
reward, the weight versions that sampled it and their order.

- A reward is a finite number, or there is none: null, NaN, an infinity, a boolean or anything
  ``float`` cannot read is no reward (``reward_value``). The control API refuses such rewards
  (``capture.storage.rewards.parse_reward``), so shards hold none; rows made by hand can.
- Weight version labels are ordered by ``version_key``: their numbers compared as numbers
  ("step-9" before "step-10"), the rest as text, vLLM's "default" (its label before any update)
  first. A list of versions is always oldest first, without repeats: its last is the newest.
- A row's versions are those its ``weight_versions`` spans name (``row_versions``); with
  ``trained_only``, only spans over a token the row trains (``loss_mask`` 1).
- ``version_step`` reads a label as a step number, for trainers that count versions in steps.

Pure: the standard library only, so the trainer's environment (no proxy) imports it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

# vLLM's label for the weights it started with, before any update.
DEFAULT_VERSION = "default"


def reward_value(value: Any) -> float | None:
    """``value`` as a reward: a finite float, else None (null, NaN, infinite, a boolean, not a
    number). A numeric string or a numpy scalar reads as its number."""
    if value is None or isinstance(value, bool):
        return None
    try:
        reward = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return reward if math.isfinite(reward) else None


def row_reward(row: Mapping[str, Any]) -> float | None:
    """A row's ``reward`` by ``reward_value``: None where it has none."""
    return reward_value(row.get("reward"))


def version_key(version: str) -> tuple[Any, ...]:
    """The order of weight version labels: their numbers compared as numbers ("step-9" before
    "step-10", "2" before "10"), the rest as text; "default" (vLLM's label before any update)
    before every other."""
    if version == DEFAULT_VERSION:
        return ((0, ""),)
    parts = re.split(r"(\d+)", version)
    return (
        (1, ""),
        *((2, int(p)) if p.isdigit() else (3, p) for p in parts if p),
    )


def ordered_versions(versions: Iterable[Any]) -> list[str]:
    """Version labels as text, oldest first (``version_key``), each once; None left out."""
    return sorted({str(v) for v in versions if v is not None}, key=version_key)


def _bounds(span: Mapping[str, Any]) -> tuple[int, int]:
    return int(span.get("start") or 0), int(span.get("end") or 0)


def span_versions(
    spans: Iterable[Mapping[str, Any]] | None, start: int | None = None, end: int | None = None
) -> list[str]:
    """The versions ``weight_versions`` spans name, oldest first; with ``start`` and ``end``,
    only spans overlapping positions [start, end) (which weights sampled one call's tokens)."""
    found = []
    for span in spans or ():
        lo, hi = _bounds(span)
        if start is not None and end is not None and not (lo < end and hi > start):
            continue
        found.append(span.get("version"))
    return ordered_versions(found)


def row_versions(row: Mapping[str, Any], trained_only: bool = True) -> list[str]:
    """The weight versions that sampled the row's tokens, oldest first. With ``trained_only``,
    only spans covering a token the row trains (``loss_mask`` 1) count; a row read without its
    ``loss_mask`` counts every span."""
    spans = row.get("weight_versions") or []
    mask = row.get("loss_mask") or []
    if trained_only and mask:
        spans = [s for s in spans if any(mask[max(_bounds(s)[0], 0) : max(_bounds(s)[1], 0)])]
    return span_versions(spans)


def rows_versions(rows: Iterable[Mapping[str, Any]], trained_only: bool = False) -> list[str]:
    """The weight versions that sampled any of ``rows`` (a session's), oldest first."""
    return ordered_versions(v for row in rows for v in row_versions(row, trained_only))


_TRAILING_NUMBER = re.compile(r"(\d+)$")


def version_step(version: str) -> int | None:
    """A weight version label as a step number: the whole label if it is an integer
    (``"12"``), else its trailing integer (``"step-12"`` → 12); None if it has none
    (``"base"``)."""
    label = version.strip()
    try:
        return int(label)
    except ValueError:
        found = _TRAILING_NUMBER.search(label)  # "step-12": 12, not -12
        return int(found.group(1)) if found else None


def weight_steps(row: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(min, max) step of the weights that sampled the row's trained tokens (``version_step``
    of each version); (None, None) when the row names no version, or none with a number."""
    steps = [s for s in map(version_step, row_versions(row)) if s is not None]
    if not steps:
        return None, None
    return min(steps), max(steps)
