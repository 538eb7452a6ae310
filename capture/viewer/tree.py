"""A session's thread rows as the trajectory viewer's tree (links, counts, the weight versions
of each call), and its calls in order with the tool calls each made."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from capture.storage.row_rules import row_reward, row_versions, span_versions
from capture.viewer.sources import json_column
from rewriter.parsers import OutputParser


def first_trained(loss_mask: Sequence[int] | None) -> int | None:
    """The position of a row's first trained token (``loss_mask`` 1), where the page opens the
    row (its sampled tokens may sit 12k prompt tokens in); None when nothing is trained."""
    for pos, mask in enumerate(loss_mask or ()):
        if mask == 1:
            return pos
    return None


def row_node(row: dict[str, Any]) -> dict[str, Any]:
    """A thread row for the tree: its links, counts and calls, no token lists;
    ``first_trained``: where its trained tokens start (None unknown: no loss mask read, or
    nothing trained)."""
    tokens = row.get("tokens")
    if tokens is None:
        tokens = len(row.get("input_ids") or ())
    trained = row.get("trained_tokens")
    if trained is None:
        trained = sum(row.get("loss_mask") or ())
    spans = [dict(s) for s in row.get("weight_versions") or ()]
    return {
        "thread_id": row["thread_id"],
        "parent_thread_id": row.get("parent_thread_id"),
        "parent_relation": row.get("parent_relation"),
        "parent_tool_call_id": row.get("parent_tool_call_id"),
        "dead": bool(row.get("dead")),
        "dead_reason": row.get("dead_reason"),
        "superseded_by": row.get("superseded_by"),
        "tokens": int(tokens),
        "trained_tokens": int(trained),
        "first_trained": first_trained(row.get("loss_mask")),
        "num_turns": int(row.get("num_turns") or 0),
        "reward": row_reward(row),
        "end_reason": row.get("end_reason"),
        "metrics": json_column(row.get("metrics")),
        "protocol": row.get("protocol"),
        "pending": bool(row.get("pending")),
        "weight_versions": spans,
        "versions": row_versions(row, trained_only=False),
        "turns": [
            dict(t, versions=versions_in(spans, t.get("start"), t.get("end")))
            for t in row.get("turns") or ()
        ],
    }


def versions_in(spans: list[dict[str, Any]], start: int | None, end: int | None) -> list[str]:
    """The weight versions whose spans overlap positions [start, end), oldest first: which
    weights sampled a call's tokens ([] where the call's positions are unknown)."""
    if start is None or end is None:
        return []
    return span_versions(spans, start, end)


def row_tree(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as a forest: each node gets ``children`` (rows whose parent it is); roots are
    rows without a parent or whose parent is not among ``rows``. Order: as written."""
    nodes = [row_node(r) for r in rows]
    by_id = {n["thread_id"]: n for n in nodes}
    roots = []
    for node in nodes:
        node["children"] = []
    for node in nodes:
        parent = by_id.get(node["parent_thread_id"] or "")
        if parent is not None and parent is not node:
            parent["children"].append(node)
        else:
            roots.append(node)
    return roots


def tool_calls(text: str, tool_parser: str, reasoning_parser: str) -> list[dict[str, Any]]:
    """The tool calls in a completion's text, as the proxy parsed them for the client."""
    parser = OutputParser(tool_parser, reasoning_parser)
    try:
        parser.feed(text)
        parser.finish()
    except Exception:  # an unparsable completion shows no calls; its text is still there
        return []
    return [{"name": c.name, "arguments": c.arguments} for c in parser.tool_calls]


def call_list(
    turns: list[dict[str, Any]], tool_parser: str = "hermes", reasoning_parser: str = "qwen3"
) -> list[dict[str, Any]]:
    """A session's calls in order, with what the client was told and the tool calls made."""
    out = []
    for t in sorted(turns, key=lambda t: (t.get("turn_index") or 0, t.get("started_at") or 0)):
        meta = json_column(t.get("metadata")) or {}
        out.append(
            {
                "request_id": t["request_id"],
                "turn_index": t.get("turn_index"),
                "thread_id": t.get("thread_id"),
                "protocol": t.get("protocol"),
                "requested_model": t.get("requested_model"),
                "backend": t.get("backend"),
                "prompt_tokens": len(t.get("prompt_ids") or ()),
                "completion_tokens": len(t.get("completion_ids") or ()),
                "finish_reason": t.get("finish_reason"),
                "response_finish_reason": t.get("response_finish_reason"),
                "latency_s": t.get("latency_s"),
                "started_at": t.get("started_at"),
                "stream": t.get("stream"),
                "assembly": meta.get("assembly") if isinstance(meta, dict) else None,
                "tool_calls": tool_calls(
                    t.get("completion_text") or "", tool_parser, reasoning_parser
                ),
            }
        )
    return out
