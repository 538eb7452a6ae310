"""Journal lines, compact: a session's journal holds one JSON line per completed call, and a
long agent session's prompts repeat its history once per call, so a line holds its prompt as
the earlier call it extends plus only the new ids, and its number arrays packed.

A line is ``{"turn": TURN_ROW, "call": CALL_ENTRY}`` (or ``{"failed": ROW}``) as before, with
these values where the JSON lists were (lines of older journals, all lists, still read):

- ``turn.prompt_ids``: ``{"ref": REQUEST_ID, "keep": K, "tail": ARRAY}``, the first K ids of
  the earlier call REQUEST_ID's prompt followed by its completion, then ``tail``; an ARRAY (or a
  list) where no earlier call of the journal shares a prefix with it.
- any other array (``completion_ids``, ``completion_logprobs``, the call's ``suffix_logprobs``,
  ``suffix_provenance``, ``sampled_logprobs``): ARRAY = ``{"n": COUNT, TYPE: DATA}``, TYPE
  ``i4`` (int32), ``i1`` (int8) or ``f4`` (float32); DATA the little-endian values, bytes
  regrouped by significance (all first bytes, then all second bytes, ...), zstd-compressed,
  base64. Logprobs become float32 here, as the shards store them; an int list that does not fit
  its type stays a list.

A line whose reference cannot be resolved (the line it names was damaged, or itself refers to
one that was) is skipped like a damaged line: a damaged line costs its call and the later calls
that build on its prompt. A line torn by a crash is the last one: no line refers to it.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import zstandard

from capture.storage.records import TurnRecord

# False: the JSON lists of before (bench/storage.py writes its baseline so).
COMPACT = True
_ZSTD_LEVEL = 3
_TYPES: dict[str, np.dtype[Any]] = {
    "i4": np.dtype("<i4"),
    "i1": np.dtype("i1"),
    "f4": np.dtype("<f4"),
}
_codec: pa.Codec | None = None
# Compressors keep their context between calls (pyarrow's make one per call: about 20 us, most of
# a short array's cost, several arrays a call); one per thread, as a context is not thread-safe.
_compressors = threading.local()


def _zstd() -> pa.Codec:
    global _codec
    if _codec is None:
        _codec = pa.Codec("zstd", compression_level=_ZSTD_LEVEL)
    return _codec


def _compress(data: bytes) -> bytes:
    compressor = getattr(_compressors, "zstd", None)
    if compressor is None:
        compressor = _compressors.zstd = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return compressor.compress(data)


def pack(values: Sequence[Any], kind: str) -> dict[str, Any] | list[Any]:
    """``values`` as an ARRAY of ``kind`` (``i4``, ``i1``, ``f4``); ints that do not fit it are
    left a list."""
    dtype = _TYPES[kind]
    given = np.asarray(values) if len(values) else np.zeros(0, dtype)
    # Anything else (None, a nested list, an int past int64) stays a list, exactly as given.
    if given.ndim != 1 or given.dtype.kind not in ("iuf" if kind == "f4" else "iu"):
        return list(values)
    if kind != "f4":
        info = np.iinfo(dtype)
        if given.size and (given.min() < info.min or given.max() > info.max):
            return list(values)
    arr = given.astype(dtype)
    grouped = arr.view(np.uint8).reshape(-1, dtype.itemsize).T.tobytes()
    data = _compress(grouped)
    return {"n": int(arr.size), kind: base64.b64encode(data).decode("ascii")}


def unpack(value: Any) -> list[Any]:
    """A list again, from an ARRAY or a list (older lines)."""
    if isinstance(value, list):
        return value
    n = int(value["n"])
    (kind,) = [k for k in value if k != "n"]
    dtype = _TYPES[kind]
    raw = _zstd().decompress(
        base64.b64decode(value[kind], validate=True), decompressed_size=n * dtype.itemsize
    )
    grouped = np.frombuffer(raw, dtype=np.uint8).reshape(dtype.itemsize, n)
    values: list[Any] = np.ascontiguousarray(grouped.T).view(dtype).reshape(n).tolist()
    return values


def _common_prefix(a: Sequence[int], b: Sequence[int], offset: int = 0) -> int:
    """How many of ``a``'s first ids equal ``b[offset:]``'s first ids."""
    n = min(len(a), len(b) - offset)
    if n <= 0:
        return 0
    # Whole lists compare without a copy; prompts run to tens of thousands of ids.
    head = a if n == len(a) else a[:n]
    if head == (b if offset == 0 and n == len(b) else b[offset : offset + n]):
        return n
    i, step = 0, 4096
    while i + step <= n and a[i : i + step] == b[offset + i : offset + i + step]:
        i += step
    while i < n and a[i] == b[offset + i]:
        i += 1
    return i


def _shared(turn: TurnRecord, prompt: Sequence[int]) -> int:
    """How many first ids of ``prompt`` are ``turn``'s prompt followed by its completion."""
    k = _common_prefix(turn.prompt_ids, prompt)
    if k == len(turn.prompt_ids):
        k += _common_prefix(turn.completion_ids, prompt, k)
    return k


def _pack_prompt(
    prompt: list[int], parent: str | None, earlier: Sequence[TurnRecord]
) -> dict[str, Any] | list[Any]:
    # Candidates: the call it continues in the tree, and the journal's last call.
    candidates = list(earlier[-1:])
    if parent is not None:
        # From the end, stopping at the first: the parent is nearly always one of the last calls,
        # and a session may hold thousands.
        found = next((t for t in reversed(earlier) if t.request_id == parent), None)
        if found is not None and found is not candidates[0]:  # most often it is the last call
            candidates.append(found)
    best, keep = None, 0
    for turn in candidates:
        k = _shared(turn, prompt)
        if k > keep:
            best, keep = turn, k
    if best is None:
        return pack(prompt, "i4")
    return {"ref": best.request_id, "keep": keep, "tail": pack(prompt[keep:], "i4")}


_CALL_ARRAYS = {"suffix_logprobs": "f4", "suffix_provenance": "i1", "sampled_logprobs": "f4"}


def encode(entry: dict[str, Any], earlier: Sequence[TurnRecord]) -> bytes:
    """One journal line (UTF-8, no newline) for ``entry``: ``{"turn": ROW, "call": CALL}`` of a call
    whose journal already holds ``earlier`` (in order), or ``{"failed": ROW}``."""
    if COMPACT and "turn" in entry:
        turn = dict(entry["turn"])
        call = dict(entry.get("call") or {})
        turn["prompt_ids"] = _pack_prompt(turn["prompt_ids"], call.get("parent"), earlier)
        turn["completion_ids"] = pack(turn["completion_ids"], "i4")
        turn["completion_logprobs"] = pack(turn["completion_logprobs"], "f4")
        for name, kind in _CALL_ARRAYS.items():
            if call.get(name) is not None:
                call[name] = pack(call[name], kind)
        entry = {"turn": turn, "call": call}
    elif not COMPACT:
        return json.dumps(entry, separators=(",", ":")).encode()
    try:
        return json.dumps(entry, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate somewhere: escaped, as JSON allows
        return json.dumps(entry, separators=(",", ":")).encode()


def decode(entry: dict[str, Any], earlier: dict[str, TurnRecord]) -> dict[str, Any]:
    """``entry`` (a parsed line) with lists again; ``earlier``: the journal's calls read so far
    by request id. Raises on a line that cannot be read (a reference to a call not there)."""
    if "turn" not in entry:
        return entry
    turn = dict(entry["turn"])
    prompt = turn["prompt_ids"]
    if isinstance(prompt, dict) and "ref" in prompt:
        ref = earlier[prompt["ref"]]
        keep = int(prompt["keep"])
        n = len(ref.prompt_ids)
        head = ref.prompt_ids[:keep] + ref.completion_ids[: max(0, keep - n)]
        if len(head) != keep:
            raise ValueError(f"prompt reference past the end of call {ref.request_id}")
        turn["prompt_ids"] = head + unpack(prompt["tail"])
    else:
        turn["prompt_ids"] = unpack(prompt)
    turn["completion_ids"] = unpack(turn["completion_ids"])
    turn["completion_logprobs"] = unpack(turn["completion_logprobs"])
    out: dict[str, Any] = {**entry, "turn": turn}
    call = entry.get("call")
    if call:
        call = dict(call)
        for name in _CALL_ARRAYS:
            if call.get(name) is not None:
                call[name] = unpack(call[name])
        out["call"] = call
    return out


def read(journal: Path) -> Iterator[dict[str, Any] | None]:
    """The journal's entries in order, arrays as lists; None for a line that cannot be read (cut
    short by a crash, damaged, or naming a call that is not there)."""
    earlier: dict[str, TurnRecord] = {}
    # errors="replace": a damaged byte costs that line at most, never the journal.
    for line in journal.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            entry = decode(json.loads(line), earlier)
            if "turn" in entry:
                turn = TurnRecord.from_row(entry["turn"])
                earlier[turn.request_id] = turn
                entry["record"] = turn
        except Exception:
            yield None
            continue
        yield entry
