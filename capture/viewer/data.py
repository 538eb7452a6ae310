"""What the trajectory viewer shows, as plain data (no HTTP here: see capture/viewer/http.py).

Sessions -> the tree of their thread rows -> one row's tokens (decoded, with loss mask,
provenance and logprobs) and its calls -> the diff of two calls of one conversation.

Rows come from a ``RowSource``: ``ShardSource`` reads an output folder's shards (the offline
viewer, and what a running proxy has written); the proxy adds its live sessions' unwritten rows
(``capture.viewer.http.LiveSource``).
"""

from __future__ import annotations

import difflib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from capture.storage.rewards import join_rewards, load_rewards
from capture.storage.shards import TURN_SCHEMA
from rewriter.parsers import OutputParser

# Tokens per page of a row: a 100k-token row is fetched and drawn a page at a time.
PAGE_TOKENS = 2000
MAX_PAGE_TOKENS = 20_000
# Equal stretches of a diff longer than this many tokens are shown shortened (ends kept).
DIFF_CONTEXT_TOKENS = 40

PROVENANCE = ("prompt", "sampled", "recomputed", "stale")
# Thread-row columns the session list and the tree need (not the token lists).
_ROW_META = (
    "session_id",
    "thread_id",
    "parent_thread_id",
    "parent_relation",
    "parent_tool_call_id",
    "dead",
    "dead_reason",
    "superseded_by",
    "num_turns",
    "protocol",
    "user_agent",
    "reward",
    "metadata",
    "end_reason",
    "metrics",
    "turns",
)

Decode = Callable[[Sequence[int]], list[str]]


def ids_only(ids: Sequence[int]) -> list[str]:
    """The decoder when no tokenizer is given: each token shown as its id."""
    return [f"⟨{i}⟩" for i in ids]


def tokenizer_decoder(tokenizer: Any) -> Decode:
    """Each token's own text (a byte-level token that is part of a character shows as the
    replacement character, as the tokenizer decodes it alone)."""

    def decode(ids: Sequence[int]) -> list[str]:
        pieces = tokenizer.convert_ids_to_tokens(list(ids))
        return [
            tokenizer.convert_tokens_to_string([p]) if p is not None else f"⟨{i}⟩"
            for i, p in zip(ids, pieces, strict=True)
        ]

    return decode


def load_decoder(tokenizer_path: str | Path | None) -> Decode:
    if tokenizer_path is None:
        return ids_only
    from rewriter.template import ChatTemplate

    return tokenizer_decoder(ChatTemplate(tokenizer_path).tokenizer)


# -- sources -----------------------------------------------------------------------------------
class RowSource(Protocol):
    def summaries(self) -> list[dict[str, Any]]:
        """Every thread row without its token lists, plus ``tokens`` and ``trained_tokens``."""

    def threads(self, session_id: str) -> list[dict[str, Any]]:
        """A session's thread rows, whole (late rewards joined)."""

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        """A session's turns rows (one per call)."""


def _files_key(directory: Path) -> tuple[tuple[str, int, int], ...]:
    if not directory.is_dir():
        return ()
    out = []
    for p in sorted(directory.glob("*.parquet")):
        if p.name.startswith((".", "_")):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        out.append((p.name, st.st_mtime_ns, st.st_size))
    return tuple(out)


class ShardSource:
    """An output folder's shards (``threads/``, ``turns/``, ``rewards/``), re-read when its
    files change. Whole rows are read per session and a few sessions are kept."""

    def __init__(self, out_dir: str | Path, keep_sessions: int = 8) -> None:
        self.out_dir = Path(out_dir)
        self._lock = threading.Lock()
        self._keep = keep_sessions
        self._summary: tuple[Any, list[dict[str, Any]]] | None = None
        self._rows: OrderedDict[tuple[str, str, Any], list[dict[str, Any]]] = OrderedDict()

    def _dataset(self, folder: str, schema: pa.Schema | None = None) -> ds.Dataset | None:
        directory = self.out_dir / folder
        if not _files_key(directory):
            return None
        files = [str(directory / name) for name, _, _ in _files_key(directory)]
        return ds.dataset(files, format="parquet", schema=schema)

    def _key(self, folder: str) -> Any:
        return (_files_key(self.out_dir / folder), _files_key(self.out_dir / "rewards"))

    def summaries(self) -> list[dict[str, Any]]:
        key = self._key("threads")
        with self._lock:
            if self._summary is not None and self._summary[0] == key:
                return self._summary[1]
        dataset = self._dataset("threads")
        rows: list[dict[str, Any]] = []
        if dataset is not None:
            names = set(dataset.schema.names)
            table = dataset.to_table(
                columns=[c for c in (*_ROW_META, "input_ids", "loss_mask") if c in names]
            )
            tokens = pc.list_value_length(table["input_ids"]).to_pylist()
            masks = table["loss_mask"].to_pylist()
            table = table.drop_columns(["input_ids", "loss_mask"])
            rows = table.to_pylist()
            for row, n, mask in zip(rows, tokens, masks, strict=True):
                row["tokens"] = n or 0
                row["trained_tokens"] = sum(mask or ())
            rows = join_rewards(rows, load_rewards(self.out_dir))
        with self._lock:
            self._summary = (key, rows)
        return rows

    def _session_rows(self, folder: str, session_id: str) -> list[dict[str, Any]]:
        key = (folder, session_id, self._key(folder))
        with self._lock:
            if key in self._rows:
                self._rows.move_to_end(key)
                return self._rows[key]
        dataset = self._dataset(folder, TURN_SCHEMA if folder == "turns" else None)
        rows: list[dict[str, Any]] = []
        if dataset is not None:
            rows = dataset.to_table(filter=ds.field("session_id") == session_id).to_pylist()
        if folder == "threads" and rows:
            rows = join_rewards(rows, load_rewards(self.out_dir))
        with self._lock:
            self._rows[key] = rows
            while len(self._rows) > self._keep:
                self._rows.popitem(last=False)
        return rows

    def threads(self, session_id: str) -> list[dict[str, Any]]:
        return self._session_rows("threads", session_id)

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        return self._session_rows("turns", session_id)


# -- sessions ----------------------------------------------------------------------------------
def _json(text: Any) -> Any:
    if not isinstance(text, str) or not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def session_list(
    summaries: list[dict[str, Any]], live: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One entry per session: its rows, calls, tokens, reward(s), metadata and end reason;
    ``live``: the proxy's live sessions (calls, tokens, last activity, backend) by id, listed
    even before they have rows."""
    live = live or {}
    by_session: dict[str, list[dict[str, Any]]] = {}
    for row in summaries:
        by_session.setdefault(row["session_id"], []).append(row)
    out = []
    for sid in sorted(set(by_session) | set(live)):
        rows = by_session.get(sid, [])
        rewards = sorted({r["reward"] for r in rows if r.get("reward") is not None})
        metadata = next((_json(r.get("metadata")) for r in rows if r.get("metadata")), None)
        state = live.get(sid)
        if metadata is None and state is not None:
            metadata = state.get("metadata") or None
        out.append(
            {
                "id": sid,
                "live": state is not None and not state.get("closed", False),
                "state": state,
                "rows": len(rows),
                "dead_rows": sum(1 for r in rows if r.get("dead")),
                "calls": sum(int(r.get("num_turns") or 0) for r in rows),
                "tokens": sum(int(r.get("tokens") or 0) for r in rows),
                "trained_tokens": sum(int(r.get("trained_tokens") or 0) for r in rows),
                "reward": rewards[0] if len(rewards) == 1 else (rewards or None),
                "metadata": metadata,
                "end_reason": next((r["end_reason"] for r in rows if r.get("end_reason")), None),
                "protocols": sorted({r["protocol"] for r in rows if r.get("protocol")}),
            }
        )
    return out


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
        "reward": row.get("reward"),
        "end_reason": row.get("end_reason"),
        "metrics": _json(row.get("metrics")),
        "protocol": row.get("protocol"),
        "pending": bool(row.get("pending")),
        "turns": [dict(t) for t in row.get("turns") or ()],
    }


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
        meta = _json(t.get("metadata")) or {}
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


# -- one row's tokens --------------------------------------------------------------------------
def token_page(
    row: dict[str, Any], decode: Decode, offset: int = 0, limit: int = PAGE_TOKENS
) -> dict[str, Any]:
    """Tokens ``offset`` .. ``offset + limit`` of a thread row: ids, text, loss mask,
    provenance, logprobs. A ValueError for an offset or limit out of range."""
    ids = row.get("input_ids") or []
    total = len(ids)
    if offset < 0 or (offset > total) or limit < 1 or limit > MAX_PAGE_TOKENS:
        raise ValueError(
            f"offset must be 0..{total} and limit 1..{MAX_PAGE_TOKENS}; got {offset}, {limit}"
        )
    end = min(total, offset + limit)
    page = list(ids[offset:end])
    return {
        "thread_id": row["thread_id"],
        "total": total,
        "offset": offset,
        "ids": page,
        "text": decode(page),
        "loss_mask": list((row.get("loss_mask") or [])[offset:end]),
        "provenance": list((row.get("provenance") or [])[offset:end]),
        "logprobs": [
            round(float(x), 5) if x is not None else None
            for x in (row.get("logprobs") or [])[offset:end]
        ],
    }


def row_overview(row: dict[str, Any]) -> dict[str, Any]:
    """A row's counts by provenance and loss mask (the legend's numbers)."""
    prov = row.get("provenance") or []
    mask = row.get("loss_mask") or []
    counts = {name: 0 for name in PROVENANCE}
    for p in prov:
        if 0 <= p < len(PROVENANCE):
            counts[PROVENANCE[p]] += 1
    return {
        "provenance": counts,
        "trained": int(sum(mask)),
        "total": len(prov),
        "first_trained": first_trained(mask),
    }


# -- diff of two calls -------------------------------------------------------------------------
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
