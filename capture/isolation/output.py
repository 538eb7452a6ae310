"""A run's output limit: the agent's stdout and stderr into its log, kept to ``output_mb``
(``OutputPump``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any


class OutputPump:
    """An agent's stdout and stderr (one pipe) into its log, at most ``cap_bytes`` of it: the
    first part written as it comes, the last ``tail_bytes`` kept in memory and written when the
    pipe closes, after a line saying how much was dropped in between. So the log ends with the
    latest output and holds at most ``cap_bytes`` plus that line. Past the cap, ``hit`` is set
    (and ``event``) and the pipe is still read to its end, so the agent never blocks on it
    before the runner stops it."""

    def __init__(self, log_path: Path, cap_bytes: int, tail_bytes: int | None = None) -> None:
        self.log_path = log_path
        self.cap_bytes = cap_bytes
        self.tail_bytes = min(cap_bytes // 4, 256 * 1024) if tail_bytes is None else tail_bytes
        self.head_bytes = cap_bytes - self.tail_bytes
        self.total = 0
        self.hit = False
        self.event = asyncio.Event()
        self._tail = bytearray()

    async def run(self, source: asyncio.StreamReader | int) -> bool:
        """Read ``source`` (a StreamReader, or a pipe's read end, which is then closed) to its
        end; True if the output limit was hit."""
        reader = await _reader_of(source) if isinstance(source, int) else source
        with open(self.log_path, "wb") as log:
            while chunk := await reader.read(64 * 1024):
                self._take(chunk, log)
            dropped = self.total - self.head_bytes - len(self._tail)
            if dropped > 0:
                log.write(
                    f"\n[agenttap: output limit of {self.cap_bytes} bytes reached: {dropped} bytes "
                    f"dropped here, the last {len(self._tail)} follow]\n".encode()
                )
            log.write(self._tail)
        return self.hit

    def _take(self, chunk: bytes, log: Any) -> None:
        head_left = self.head_bytes - min(self.total, self.head_bytes)
        self.total += len(chunk)
        if head_left > 0:
            log.write(chunk[:head_left])  # a local file: page cache, no wait worth a thread
            chunk = chunk[head_left:]
        if chunk:
            self._tail += chunk
            if len(self._tail) > self.tail_bytes:
                del self._tail[: len(self._tail) - self.tail_bytes]
        if self.total > self.cap_bytes and not self.hit:
            self.hit = True
            self.event.set()


async def _reader_of(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


async def pump_output(source: asyncio.StreamReader | int, log_path: Path, cap_bytes: int) -> bool:
    """``OutputPump(log_path, cap_bytes).run(source)``: True if the output limit was hit."""
    return await OutputPump(log_path, cap_bytes).run(source)
