"""One generation on one vLLM server: a whole answer (``_complete_once``) or its stream
(``stream``), read, checked and paced; an answer that is not vLLM's shape, a cut stream and a
stall all raise PolicyError.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

from rewriter.canonical import SamplingParams
from rewriter.vllm_answers import (
    CompletionDelta,
    PolicyError,
    answer_choices,
    answer_json,
    completions_delta,
    generate_delta,
    malformed_answer,
)
from rewriter.vllm_probe import Probing
from rewriter.vllm_request import GENERATE_PATH
from rewriter.vllm_stream import (
    LineSplitter,
    Pacer,
    earliest,
    passed,
    read_pieces,
    stream_line_limit,
)


class Generating(Probing):
    """``Probing`` plus the generations themselves."""

    async def _complete_once(
        self, prompt_ids: list[int], params: SamplingParams, prompt_json: str | None = None
    ) -> AsyncIterator[CompletionDelta]:
        path, body = await self._body(prompt_ids, params, stream=False, prompt_json=prompt_json)
        # A whole answer's tokens all come at once: the body must be in within the timeout
        # (a server trickling whitespace into it makes no progress).
        try:
            async with self._bounded(self._deadline()):
                resp = await self._post(path, body)
                async with resp:
                    raw = await resp.read()
        except TimeoutError as exc:
            raise self._stalled() from exc
        parse = generate_delta if path == GENERATE_PATH else completions_delta
        choices = answer_choices(answer_json(raw, "an answer"))
        if not choices:
            raise malformed_answer("an answer without choices", raw)
        delta = parse(choices[0])
        if delta.finish_reason is None:
            raise malformed_answer(
                "an answer whose generation did not finish (no finish_reason)", raw
            )
        yield delta

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, prompt_json: str | None = None
    ) -> AsyncIterator[CompletionDelta]:
        """One generation's pieces as the server sends them. Whatever is not vLLM's SSE (a
        line that is not JSON, a chunk of the wrong shape), a stream that ends before the
        generation did (no finish_reason, no ``[DONE]``) and a stream without a new token for
        ``progress_timeout_s`` raise PolicyError: the caller answers it as an error, never
        as a complete answer."""
        path, body = await self._body(prompt_ids, params, stream=True, prompt_json=prompt_json)
        parse = generate_delta if path == GENERATE_PATH else completions_delta
        deadline = self._deadline()
        try:
            async with self._bounded(deadline):
                resp = await self._post(path, body)
        except TimeoutError as exc:
            raise self._stalled() from exc
        finished = False
        lines = LineSplitter(stream_line_limit(len(prompt_ids)))
        fast = path != GENERATE_PATH  # vLLM's /v1/completions lines: completions_stream_line
        pacer = Pacer(self.flush_interval_s)
        loop = asyncio.get_running_loop()
        content = resp.content
        # While pieces are held (``pacer.holding``), the stream waits for the interval's end
        # without reading: the tokens that come meanwhile wait in the response's buffer (the
        # event loop still moves each from the socket; this task is not woken for it) and are
        # parsed in one go. The stream's end ends that wait. Pausing the socket's reads as well
        # saved nothing measurable and would hold the finish until the interval ended.
        sleeping: list[asyncio.Future[None]] = []

        def woken() -> None:
            for waiter in sleeping:
                if not waiter.done():
                    waiter.set_result(None)

        if pacer.interval:
            content.on_eof(woken)
        async with resp:
            while True:
                # Bounded per wait, never across a yield: the caller's own awaits (writing to
                # a slow client) are not the policy's time.
                try:
                    if pacer.holding(loop.time()) and not content.is_eof():
                        waiter = loop.create_future()
                        sleeping[:] = [waiter]
                        bound = self._bounded(earliest(deadline, pacer.next_flush))
                        try:
                            async with bound:
                                await waiter
                        except TimeoutError:
                            if bound.abandoned:
                                raise
                        # The interval is over, or the policy's deadline came: what came
                        # meanwhile is read now; nothing at all by the deadline is a stall.
                        data = content.read_nowait(-1)
                        ended = not data and content.at_eof()
                        if not data and not ended and passed(deadline, loop.time()):
                            raise TimeoutError
                    else:
                        async with self._bounded(deadline):
                            data = await content.readany()
                        ended = not data
                except (TimeoutError, aiohttp.ClientError) as exc:
                    # What was read before the failure goes on first, as it came.
                    for delta in pacer.release():
                        yield delta
                    if isinstance(exc, TimeoutError):  # ours, or the connection's read timeout
                        raise self._stalled() from exc
                    raise
                # Every line already here is parsed before any is handed on: the tokens that
                # came in one read (the policy ran ahead of this proxy or of its client) go on
                # as one piece, one event to the client rather than one per token; so do those
                # that came within ``flush_interval_s`` of the last piece (``Pacer``).
                fed = lines.rest() if ended else lines.feed(data) if data else []
                read = read_pieces(fed, parse, fast)
                if read.progress:
                    deadline = self._deadline()
                finished = finished or read.finished
                final = read.finished or read.done or ended or read.error is not None
                for delta in pacer.take(read.pieces, loop.time(), final):
                    yield delta
                if read.error is not None:
                    raise read.error
                if read.done:
                    return
                if ended:
                    break
        if not finished:
            # Status 0: the server went away mid-generation (a crash, a restart): retryable.
            raise PolicyError(
                f"the policy server at {self.base_url} ended its stream before the generation "
                "finished (no finish_reason, no [DONE]); the answer is incomplete"
            )
