"""A generation's stream as read here (rewriter/vllm_generate.py): its bytes split into lines,
bounded (``LineSplitter``, ``stream_line_limit``); the lines of one read as pieces
(``read_pieces``); when pieces go on (``Pacer``: ``agenttap_stream_flush_ms``); and the text of a
generation resumed after an abort, decoded from its stitched ids (``ResumedText``). No I/O here:
the client's loop does the reading and the waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rewriter.vllm_answers import (
    CompletionDelta,
    PolicyError,
    answer_choices,
    answer_json,
    coalesce,
    completions_stream_line,
    malformed_answer,
)

logger = logging.getLogger(__name__)

# The longest stream line read from a policy server, beside the prompt's ids it echoes: twice
# aiohttp's 64 KiB read buffer.
MAX_LINE_BYTES = 2 * 2**16
# vLLM echoes the prompt's ids in a stream's first chunk (``return_token_ids``): up to this many
# bytes an id ("2147483647, "), so a 100,000-token prompt's first line is about a megabyte.
ECHO_BYTES_PER_ID = 12


def stream_line_limit(prompt_len: int) -> int:
    """The longest line a generation's stream may send: bounded (a server sending garbage with
    no newline cannot fill memory), and room for its prompt's echo, however long the prompt."""
    return MAX_LINE_BYTES + ECHO_BYTES_PER_ID * prompt_len


class LineSplitter:
    """Bytes as they are read -> the complete lines among them (stripped), bounded."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self._partial: list[bytes] = []
        self._size = 0
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        parts = data.split(b"\n")
        if len(parts) == 1:
            self._keep(data)
            return []
        if self._partial:
            parts[0] = b"".join(self._partial) + parts[0]
            self._partial, self._size = [], 0
        longest = max(map(len, parts[:-1]))
        if longest > self._limit:
            raise malformed_answer("an over-long line", f"{longest} bytes")
        self._keep(parts.pop())
        return [p.strip() for p in parts]

    def rest(self) -> list[bytes]:
        """What is left when the stream ends (a last line without its newline)."""
        line = b"".join(self._partial).strip()
        self._partial, self._size = [], 0
        return [line] if line else []

    def _keep(self, data: bytes) -> None:
        if data:
            self._partial.append(data)
            self._size += len(data)
            if self._size > self._limit:
                raise malformed_answer("an over-long line", f"over {self._limit} bytes")


class ResumedText:
    """Incremental text of a completion's ids (the classic prefix/read-offset detokenizer):
    a piece is emitted once it no longer ends inside a character."""

    def __init__(self, decode: Callable[[list[int]], str], prefix: int, read: int) -> None:
        self._decode = decode
        self._prefix = prefix  # ids before this only give context to the next piece
        self._read = read  # ids before this have had their text emitted

    @classmethod
    def start(
        cls, decode: Callable[[list[int]], str], ids: list[int], emitted: str
    ) -> ResumedText | None:
        """Pick up after ``emitted``, the text given out for ``ids`` so far (a server holds
        back a last incomplete character, so it may stand for a few ids less)."""
        for read in range(len(ids), max(-1, len(ids) - 8), -1):
            if decode(ids[:read]) == emitted:
                return cls(decode, max(0, read - 6), read)
        logger.warning("resumed generation: its text so far does not match its ids")
        return None

    def step(self, ids: list[int], final: bool = False) -> str:
        before = self._decode(ids[self._prefix : self._read])
        text = self._decode(ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return text[len(before) :]


@dataclass
class ReadPieces:
    """What the lines of one read held: the pieces to hand on (keep-alives left out), whether a
    token or a finish came (the policy made progress), whether a finish or ``[DONE]`` came, and
    the error a line raised, after the pieces before it."""

    pieces: list[CompletionDelta] = field(default_factory=list)
    progress: bool = False
    finished: bool = False
    done: bool = False
    error: PolicyError | None = None


def read_pieces(
    lines: list[bytes], parse: Callable[[dict[str, Any]], CompletionDelta], fast: bool
) -> ReadPieces:
    """The SSE ``lines`` of a generation's stream as pieces. ``fast``: the lines are
    ``/v1/completions``', read in one pass where they have vLLM's usual shape
    (``completions_stream_line``); any other line is read by the careful path, ``parse`` of each
    checked choice, which raises on what is not vLLM's."""
    read = ReadPieces()
    try:
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank lines, SSE comments (": ping"), event names
            payload = line[5:].strip()
            if payload == b"[DONE]":
                read.done = True
                break
            pieces = completions_stream_line(payload) if fast else None
            if pieces is None:
                pieces = [parse(c) for c in answer_choices(answer_json(payload, "a stream line"))]
            for piece in pieces:
                if piece.token_ids or piece.finish_reason is not None:
                    read.progress = True
                    read.finished = read.finished or piece.finish_reason is not None
                elif not (piece.text or piece.weight_versions):
                    # A keep-alive: not passed on, so that a caller waiting for the first piece
                    # before it answers (a status line) still waits for a real one.
                    continue
                read.pieces.append(piece)
    except PolicyError as exc:
        read.error = exc
    return read


def handed_on(pieces: list[CompletionDelta]) -> list[CompletionDelta]:
    """``pieces`` as few as can be (``coalesce``), each saying whether another follows at once
    (``more``: a writer sends those in one write)."""
    pieces = coalesce(pieces)
    for i, piece in enumerate(pieces):
        piece.more = i < len(pieces) - 1
    return pieces


class Pacer:
    """When a stream's pieces go on: the first at once, then none sooner than ``interval``
    seconds after the last (0: each read's as they come). Pieces that come sooner are held and go
    with the next; a finish, the stream's end or an error lets them go at once. Times are the
    caller's clock's."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.held: list[CompletionDelta] = []
        self.next_flush = 0.0  # the earliest time the next piece may go: at once for the first

    def holding(self, now: float) -> bool:
        """Whether pieces wait for the interval's end (the stream need not read till then)."""
        return bool(self.held) and now < self.next_flush

    def take(self, pieces: list[CompletionDelta], now: float, final: bool) -> list[CompletionDelta]:
        """What goes on now of ``pieces`` (just read) and those held, as few as can be; the rest
        is held. ``final``: a finish, the stream's end or an error came."""
        if not self.interval:
            return handed_on(pieces)
        self.held += pieces
        if not (final or now >= self.next_flush):
            return []
        out, self.held = self.held, []
        if out:  # keep-alives alone send nothing: no interval starts
            self.next_flush = now + self.interval
        return handed_on(out)

    def release(self) -> list[CompletionDelta]:
        """Everything held, now (the stream failed: what was read goes on before the error)."""
        out, self.held = self.held, []
        return handed_on(out)


def passed(deadline: float | None, now: float) -> bool:
    return deadline is not None and now >= deadline


def earliest(a: float | None, b: float | None) -> float | None:
    """The earlier of two deadlines (None: never)."""
    if a is None:
        return b
    return a if b is None or a <= b else b
