"""Calls answered whole are answered in-process: a routed call whose body mitmproxy holds whole
goes to ``Gateway.answer_buffered`` in this event loop (no loopback connection), and the answer
is set as ``flow.response``. Runs after the main addon's ``request`` hook, which routes the
call; what may stream goes over the loopback listener as before."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from aiohttp import web
from mitmproxy import connection, http

from capture.gateway import Gateway
from capture.pipeline.bodies import BufferedRequest, NeedsLoopback

# A body that may ask for a stream; answered over the loopback listener (see answer_buffered).
MAY_STREAM = re.compile(rb'"stream"\s*:\s*true')


class InProcessAnswers:
    def __init__(self, gateway: Callable[[], Gateway | None]) -> None:
        self._gateway = gateway
        # client connection id -> its calls being answered in-process (cancelled if it leaves)
        self._buffered_calls: dict[str, set[asyncio.Task[web.Response]]] = {}

    def client_disconnected(self, client: connection.Client) -> None:
        # As the loopback listener cancels the handler of a client that left: the policy
        # stops generating for nobody, and no turn is recorded that the client never saw.
        for task in self._buffered_calls.pop(client.id, ()):
            task.cancel()

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.get("agenttap_routed") and not flow.request.stream:
            await self.answer_buffered(flow)

    async def answer_buffered(self, flow: http.HTTPFlow) -> None:
        """Answer a routed call whose body is whole right here, through the gateway's handlers
        in this event loop, instead of over the loopback connection. Calls that may stream
        (``"stream": true`` in the body, Gemini's stream route), WebSocket upgrades and the
        control host still go over the loopback: mitmproxy streams only what a server sends
        it. A stream this check misses (an escaped key) is handed back, untouched, by the
        gateway and goes over the loopback too."""
        gateway = self._gateway()
        req = flow.request
        body = req.raw_content
        if (
            gateway is None
            or flow.response is not None
            or body is None
            or MAY_STREAM.search(body)
            or "streamgeneratecontent" in req.path.lower()
            or "Upgrade" in req.headers
        ):
            return
        buffered = BufferedRequest.of(
            req.method, req.path, list(req.headers.items(multi=True)), body
        )
        task = asyncio.ensure_future(gateway.answer_buffered(buffered))
        calls = self._buffered_calls.setdefault(flow.client_conn.id, set())
        calls.add(task)
        try:
            answer = await task
        except NeedsLoopback:
            return  # e.g. a "stream": true spelled with escapes: the loopback streams it
        except web.HTTPException as exc:
            answer = exc
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # mitmproxy is stopping
            flow.kill()  # the client left
            return
        finally:
            calls.discard(task)
            if not calls:
                self._buffered_calls.pop(flow.client_conn.id, None)
        content = answer.body
        if not isinstance(content, bytes | bytearray | None):  # handlers answer bytes
            raise TypeError(f"agenttap: an in-process answer with a {type(content).__name__} body")
        headers = [
            (k.encode(), v.encode())
            for k, v in answer.headers.items()
            if k.lower() not in ("content-length", "transfer-encoding")
        ]
        flow.response = http.Response.make(
            answer.status, bytes(content or b""), http.Headers(headers)
        )
        flow.metadata["agenttap_in_process"] = True
