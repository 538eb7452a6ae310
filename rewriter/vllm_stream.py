"""A generation's stream as read here (rewriter/vllm_client.py): its bytes split into lines,
bounded (``LineSplitter``, ``stream_line_limit``), and the text of a generation resumed after an
abort, decoded from its stitched ids (``ResumedText``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rewriter.vllm_answers import malformed_answer

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
