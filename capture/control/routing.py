"""The control API's route table (method, path pattern, handler, who may call it) resolved by
aiohttp's ``UrlDispatcher``, and the bearer-token check every route but the open ones passes.

The API is not an aiohttp application of its own: the gateway's listener and the proxy's
loopback (``agenttap.local``) hand every request to ``ControlAPI.handle``, which resolves it
here. The token check runs before the route is resolved, as it always has: without the token an
unknown path answers 401, not 404, so the routes a caller cannot use stay unnamed.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from aiohttp.web_urldispatcher import MatchInfoError

from capture.control.answers import error

Handler = Callable[..., Awaitable[web.StreamResponse]]
# "token": wants 'Authorization: Bearer TOKEN'; "open": anyone; "detail": anyone, and the
# handler is told whether the caller holds the token (GET /ready says more to it).
Access = Literal["token", "open", "detail"]

NO_TOKEN = (
    "agenttap: this route wants 'Authorization: Bearer TOKEN'; the token is printed "
    "at start as AGENTTAP_TOKEN=... (or give your own: --set agenttap_token_file=FILE, a "
    "file only you can read)"
)
WRONG_TOKEN = "agenttap: wrong token (see AGENTTAP_TOKEN= in the proxy's log)"


@dataclass(frozen=True)
class Route:
    """One control route: ``path`` is an aiohttp pattern (``/sessions/{id}/close``) whose
    parts are passed to ``handler`` after the request, in order."""

    method: str
    path: str
    handler: Handler
    access: Access = "token"


def bearer_state(authorization: str, token: str) -> str:
    """An ``Authorization`` header checked against the control API's token: ``ok``, ``wrong``,
    or "" when it holds no bearer token (the addon tells the gateway this word, through the
    proxy, after stripping the header)."""
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return ""
    ok = bool(token) and secrets.compare_digest(given.strip().encode(), token.encode())
    return "ok" if ok else "wrong"


def token_refusal(request: web.Request, token: str, bearer: str | None) -> web.Response | None:
    """None when the caller holds the token, else the 401 (none given) or 403 (a wrong one).
    ``bearer``: through the proxy, the addon checked the header already ("ok", "wrong", ""
    for none); None: the request's own ``Authorization`` header is checked."""
    if bearer is None:
        bearer = bearer_state(request.headers.get("Authorization", ""), token)
    if not bearer:
        return error(401, NO_TOKEN)
    if bearer != "ok":
        return error(403, WRONG_TOKEN)
    return None


class RouteTable:
    """``routes`` in an aiohttp ``UrlDispatcher``; ``access`` is per path (all methods of a
    path share it, so a wrong method on an open path is a 405 without the token)."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self.routes = tuple(routes)
        self.router = web.UrlDispatcher()
        self._by_route: dict[tuple[str, str], Route] = {}
        self._access: dict[str, Access] = {}
        for route in self.routes:
            # add_route, not add_get: a GET route answers HEAD with a 405, as it always has.
            self.router.add_route(route.method, route.path, route.handler)
            self._by_route[(route.method, route.path)] = route
            self._access[route.path] = route.access

    def access(self, path: str) -> Access:
        """Who may call ``path`` (a literal one: the open routes have no parameters)."""
        return self._access.get(path, "token")

    async def resolve(self, request: web.Request, path: str) -> tuple[Route, tuple[str, ...]] | int:
        """The route of ``request`` (at ``path``, its path without a trailing slash) and its
        path arguments; else 404 (no such path) or 405 (not with this method)."""
        if path != request.path:
            request = request.clone(rel_url=request.rel_url.with_path(path))
        match = await self.router.resolve(request)
        if isinstance(match, MatchInfoError):
            return match.http_exception.status
        args = tuple(match.values())
        # aiohttp decodes a path argument after matching: "a%2F..%2Fb" would be one id holding
        # "/" and "..". An id is one segment of the decoded path, as before the table: 404.
        if any("/" in arg for arg in args):
            return 404
        info = match.route.resource
        assert info is not None
        route = self._by_route[(match.route.method, info.canonical)]
        return route, args
