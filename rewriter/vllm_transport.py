"""The HTTP side of a vLLM client: the server's address and connection pool, requests posted to
it, and the deadlines a generation waits under (``abandon`` ends them early).

The generation, probing, scoring and resuming parts of ``VLLMClient`` (rewriter/vllm_client.py)
build on this.
"""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any

import aiohttp

from rewriter.policy_url import parse_policy_url, serves
from rewriter.vllm_answers import PolicyError
from rewriter.vllm_request import JSON_CONTENT, dump_body


class _Bounded:
    """``asyncio.timeout_at(deadline)``, listed in ``bounds`` while it runs. A class, not a
    generator-based context manager: a stream enters one per read, for every token.
    ``abandoned``: the deadline was made to expire early (``VLLMClient.abandon``)."""

    __slots__ = ("_bounds", "_timeout", "abandoned")

    def __init__(self, bounds: set[_Bounded], deadline: float | None) -> None:
        self._bounds = bounds
        self._timeout = asyncio.timeout_at(deadline)
        self.abandoned = False

    def expire(self, now: float) -> None:
        self.abandoned = True
        self._timeout.reschedule(now)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()
        self._bounds.add(self)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bounds.discard(self)
        await self._timeout.__aexit__(kind, exc, tb)  # raises TimeoutError where it expired


class Transport:
    """One vLLM server as HTTP: ``base_url`` (``http://HOST:PORT`` or ``unix:/PATH``, its
    socket; then ``session`` must connect to that socket: ``rewriter.policy_url.connector``)."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        progress_timeout_s: float | None = None,
        flush_interval_s: float = 0.0,
    ) -> None:
        """``progress_timeout_s``: the longest a generation may go without a new token (the
        first one included) before it fails. ``flush_interval_s``: the least time between two
        pieces a stream hands on (see ``VLLMClient``)."""
        address = parse_policy_url(base_url)
        if not serves(session, address.url):
            raise ValueError(
                f"the HTTP session given for {address.url} does not connect to it (a unix "
                "socket's server needs a session on rewriter.policy_url.connector(url))"
            )
        # The server's name (logs, replicas, rows' backend); requests go to ``url(path)``.
        self.base_url = address.url.rstrip("/")
        self._http_base = address.http_base
        self._session = session
        self.progress_timeout_s = progress_timeout_s
        if flush_interval_s < 0:
            raise ValueError(f"flush_interval_s must be 0 or more, not {flush_interval_s!r}")
        self.flush_interval_s = flush_interval_s
        # The deadlines generations wait under here (``abandon`` ends them early).
        self._bounds: set[_Bounded] = set()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The connection pool this server is reached through (TCP, or its unix socket)."""
        return self._session

    def url(self, path: str) -> str:
        """What an HTTP request for ``path`` on this server is addressed to."""
        return f"{self._http_base}{path}"

    def _stalled(self) -> PolicyError:
        limit = self.progress_timeout_s
        why = f" (no new token for {limit:g} s)" if limit else ""
        return PolicyError(
            f"the policy server at {self.base_url} did not answer in time{why}; "
            "option agenttap_policy_timeout"
        )

    def _bounded(self, deadline: float | None) -> _Bounded:
        """``asyncio.timeout_at(deadline)`` for a generation's wait on this server, which
        ``abandon`` can make expire at once."""
        return _Bounded(self._bounds, deadline)

    def abandon(self) -> int:
        """Every generation waiting on this server now fails as stalled (retryable: with a
        failover it goes on on another server from its tokens so far): the server was found
        paused or asleep, where it would wait for the policy timeout. How many were waiting."""
        now = asyncio.get_running_loop().time()
        bounds = list(self._bounds)
        for bound in bounds:
            bound.expire(now)
        return len(bounds)

    def _deadline(self) -> float | None:
        """When a generation that makes no progress from now on fails (None: never)."""
        if self.progress_timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.progress_timeout_s

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        try:
            resp = await self._session.post(
                self.url(path), data=dump_body(body), headers=headers or JSON_CONTENT
            )
        except aiohttp.ServerTimeoutError as exc:
            raise PolicyError(
                f"the policy server at {self.base_url} did not answer in time ({exc}); "
                "option agenttap_policy_timeout"
            ) from exc
        except aiohttp.ClientError as exc:
            raise PolicyError(f"cannot reach the policy server at {self.base_url}: {exc}") from exc
        if resp.status != 200:
            text = await resp.text()
            resp.release()
            try:
                message = json.loads(text).get("error", {}).get("message") or text
            except (json.JSONDecodeError, AttributeError):
                message = text
            raise PolicyError(
                f"policy server answered {resp.status}: {message}{status_hint(resp.status)}",
                resp.status,
            )
        return resp


def status_hint(status: int, listing: bool = False) -> str:
    """What a refusal by the policy server most likely means, for its error ('' for none).
    ``listing``: of ``GET /v1/models``, which every vLLM serves (elsewhere a 404 is vLLM's own
    "no such model")."""
    if status in (401, 403):
        return (
            "; the server wants a key, and agenttap sends none: serve vLLM without --api-key "
            "where only agenttap reaches it (a private socket: docs/SECURITY.md), or check that "
            "agenttap_policy_url names a vLLM server"
        )
    if status == 404 and listing:
        return (
            "; is it a vLLM server? agenttap_policy_url names the server itself "
            "(http://HOST:PORT or unix:/PATH), agenttap adds vLLM's routes"
        )
    return ""
