"""The trainer's own advantages, as its adapter sent them (``POST /sessions/{id}/advantage``),
with the trainer's time for their step where it measured it: one JSON line each in
``OUT/advantages.jsonl``, the last one given for a session wins.

Nothing trains on them: they record what the trainer used (its grouping, its scaling, e.g.
TRL's ``scale_rewards="group"``) so that the viewer shows that, and not its own estimate (the
reward less the group's mean), beside the rows.

    write_advantage(Path("OUT"), "sess-1", 0.71, step=3, step_s=41.5)
    load_advantages(Path("OUT"))
    # {"sess-1": {"advantage": 0.71, "step": 3, "step_s": 41.5, "set_at": ...}}

``step_s`` is the trainer's own time for that step, where its adapter measured it: the viewer's
time per step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from capture.storage.rewards import is_finite_number

logger = logging.getLogger(__name__)

ADVANTAGES_FILE = "advantages.jsonl"


def parse_advantage(value: Any) -> float:
    """A finite number; ValueError, in words for the caller, for anything else."""
    if not is_finite_number(value):
        raise ValueError(f'"advantage" must be a finite number, not {value!r}')
    return float(value)


def parse_step(value: Any) -> int | None:
    """The trainer step it belongs to: a whole number from 0, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f'"step" must be a whole number from 0, not {value!r}')
    return value


def parse_step_s(value: Any) -> float | None:
    """The trainer's time for the step, in seconds: a finite number from 0, or None."""
    if value is None:
        return None
    if not is_finite_number(value) or value < 0:
        raise ValueError(f'"step_s" must be a finite number of seconds from 0, not {value!r}')
    return float(value)


def write_advantage(
    out: Path, session_id: str, advantage: float, step: int | None, step_s: float | None = None
) -> Path:
    """Append one advantage (one ``write`` of one line on a file opened to append: lines from
    concurrent calls do not interleave)."""
    path = out / ADVANTAGES_FILE
    entry = {"session_id": session_id, "advantage": advantage, "step": step, "set_at": time.time()}
    if step_s is not None:
        entry["step_s"] = step_s
    line = json.dumps(entry)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    return path


def load_advantages(out: Path) -> dict[str, dict[str, Any]]:
    """Each session's last advantage: ``{"advantage", "step", "step_s", "set_at"}`` (``step_s``
    None where the trainer gave none). A line that is not one (a torn last line, an edit, a bad
    ``step_s``) is skipped with a warning."""
    path = out / ADVANTAGES_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    found: dict[str, dict[str, Any]] = {}
    bad = 0
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            sid = entry["session_id"]
            value = parse_advantage(entry["advantage"])
            step_s = parse_step_s(entry.get("step_s"))
        except (ValueError, KeyError, TypeError, AttributeError):
            bad += 1
            continue
        if isinstance(sid, str):
            found[sid] = {
                "advantage": value,
                "step": entry.get("step"),
                "step_s": step_s,
                "set_at": entry.get("set_at"),
            }
    if bad:
        logger.warning("agenttap: %s: %d line(s) are not advantages; skipped", path, bad)
    return found
