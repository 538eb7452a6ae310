"""The diff of two calls of one conversation, for the trajectory viewer: what the later prompt
kept, dropped and added of the earlier call (the scaffold's rewrites, the new turns)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from capture.viewer.tokens import Decode

# Equal stretches of a diff longer than this many tokens are shown shortened (ends kept).
DIFF_CONTEXT_TOKENS = 40


def _segment(decode: Decode, ids: Sequence[int], shorten: bool) -> dict[str, Any]:
    ids = list(ids)
    if shorten and len(ids) > 2 * DIFF_CONTEXT_TOKENS:
        head, tail = ids[:DIFF_CONTEXT_TOKENS], ids[-DIFF_CONTEXT_TOKENS:]
        return {
            "tokens": len(ids),
            "text": "".join(decode(head)),
            "tail": "".join(decode(tail)),
            "elided": len(ids) - 2 * DIFF_CONTEXT_TOKENS,
        }
    return {"tokens": len(ids), "text": "".join(decode(ids))}


def _opcodes(a: list[int], b: list[int]) -> list[tuple[str, int, int, int, int]]:
    """difflib's opcodes, the common prefix and suffix taken off first: a later call mostly
    extends an earlier one, and matching 100k-token sequences whole would take seconds."""
    n = min(len(a), len(b))
    pre = 0
    while pre < n and a[pre] == b[pre]:
        pre += 1
    suf = 0
    while suf < n - pre and a[len(a) - 1 - suf] == b[len(b) - 1 - suf]:
        suf += 1
    mid_a, mid_b = a[pre : len(a) - suf], b[pre : len(b) - suf]
    out: list[tuple[str, int, int, int, int]] = []
    if pre:
        out.append(("equal", 0, pre, 0, pre))
    if mid_a or mid_b:
        matcher = difflib.SequenceMatcher(None, mid_a, mid_b, autojunk=len(mid_b) > 5000)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            out.append((tag, i1 + pre, i2 + pre, j1 + pre, j2 + pre))
    if suf:
        out.append(("equal", len(a) - suf, len(a), len(b) - suf, len(b)))
    return out


def diff_calls(earlier: dict[str, Any], later: dict[str, Any], decode: Decode) -> dict[str, Any]:
    """What ``later``'s prompt kept, dropped and added of ``earlier``'s conversation (its prompt
    and what it sampled): the scaffold's rewrites show as ``delete`` / ``replace``, the new
    turns (tool results, the next user message) as ``insert`` at the end."""
    a = list(earlier.get("prompt_ids") or []) + list(earlier.get("completion_ids") or [])
    b = list(later.get("prompt_ids") or [])
    ops = []
    for tag, i1, i2, j1, j2 in _opcodes(a, b):
        op: dict[str, Any] = {"op": tag, "a_start": i1, "a_end": i2, "b_start": j1, "b_end": j2}
        if tag == "equal":
            op["a"] = _segment(decode, a[i1:i2], shorten=True)
        else:
            if i2 > i1:
                op["a"] = _segment(decode, a[i1:i2], shorten=False)
            if j2 > j1:
                op["b"] = _segment(decode, b[j1:j2], shorten=False)
        ops.append(op)
    kept = sum(o["a_end"] - o["a_start"] for o in ops if o["op"] == "equal")
    return {
        "a": earlier["request_id"],
        "b": later["request_id"],
        "a_tokens": len(a),
        "b_tokens": len(b),
        "kept": kept,
        # The later prompt extends the earlier call exactly: nothing was rewritten.
        "extends": b[: len(a)] == a,
        "ops": ops,
    }
