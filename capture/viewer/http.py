"""The trajectory viewer over HTTP: the page at ``/ui/`` and the JSON it reads at ``/ui/api/``.

Served by a running proxy on its API listener (``http://HOST:API_PORT/ui/``; the data routes
want the control API's token, which the page takes from its address: ``/ui/#token=TOKEN``), and
offline over a folder of shards with one command:

    .venv/bin/python -m capture.viewer_http OUT [--tokenizer DIR] [--port 8765]

The page (``/ui/``), its scripts (``/ui/viewer.js``, ``/ui/plots.js``) and its icon
(``/ui/favicon.ico``) hold no data and answer without the token; every ``/ui/api/`` route wants
it.

Routes: ``GET /ui/api/sessions?sort=KEY&order=desc&filter=KEY=VALUE&q=TEXT&offset=&limit=`` (a
page of the session list, sorted and filtered by a field or any metadata key),
``GET /ui/api/run?by=trainer_step|version|KEY[&compare=OUT2]`` (per step: reward mean and
spread, sessions per status, tokens, time; and the groups; with ``compare``, another run's
output folder, its steps too, for the page to draw over this run's),
``GET /ui/api/groups/{group_id}`` (a group's rollouts side by side, with advantages),
``GET /ui/api/sessions/{id}`` (its row tree and calls),
``GET /ui/api/sessions/{id}/rows/{thread_id}?offset=&limit=[&overview=1]`` (a page of a row's
tokens; the row's counts with the first page, or with ``overview=1``),
``GET /ui/api/sessions/{id}/diff?a=REQUEST_ID&b=REQUEST_ID``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import struct
import sys
import zlib
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_urldispatcher import MatchInfoError

from capture.ports import GatewayCore
from capture.storage.out_folder import nearby_outs
from capture.viewer import data as viewer
from capture.viewer.data import Decode, RowSource, ShardSource
from capture.viewer.sources import OtherRuns

logger = logging.getLogger(__name__)

UI_PREFIX = "/ui"
ICON_PATH = f"{UI_PREFIX}/favicon.ico"
# Groups the run view lists (newest first); the session list filters by any group beyond.
GROUPS_SHOWN = 500


# The page's files: they hold no data (the page reads it from /ui/api/ with the token).
STATIC = {
    "index.html": "text/html",
    "viewer.js": "text/javascript",
    "plots.js": "text/javascript",
}


def _static(name: str) -> bytes:
    return resources.files("capture.viewer").joinpath(f"ui/{name}").read_bytes()


def _png(size: int, colour: Callable[[int, int], bytes]) -> bytes:
    """A ``size`` x ``size`` RGBA PNG; ``colour(x, y)``: a pixel's 4 bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    raw = b"".join(b"\x00" + b"".join(colour(x, y) for x in range(size)) for y in range(size))
    header = struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


@functools.cache
def icon() -> bytes:
    """The page's icon, an .ico holding one 32x32 PNG: lines of tokens on the header's blue,
    prompt grey, sampled white, the sampled ones underlined green (trained). Drawn here, it
    holds no data, so it answers without the token."""
    blue, grey = b"\x24\x34\x47\xff", b"\x9e\xa7\xb0\xff"
    white, green = b"\xff\xff\xff\xff", b"\x4c\xaf\x50\xff"
    bars = [(7, 9, 6, 26, grey), (12, 14, 6, 19, grey), (17, 19, 6, 24, white)]
    bars.append((22, 24, 6, 24, green))

    def colour(x: int, y: int) -> bytes:
        for y0, y1, x0, x1, c in bars:
            if y0 <= y < y1 and x0 <= x < x1:
                return c
        return blue

    png = _png(32, colour)
    # ICONDIR (reserved, type 1 = icon, one image) and its entry (32x32, 32 bpp, PNG at 22).
    return (
        struct.pack("<HHH", 0, 1, 1)
        + struct.pack("<BBBBHHII", 32, 32, 0, 0, 1, 32, len(png), 22)
        + png
    )


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "status": status}}, status=status)


class LiveSource:
    """A running proxy's rows: what its shards hold plus its live sessions' unwritten calls."""

    def __init__(self, gateway: GatewayCore) -> None:
        self.gateway = gateway
        self.shards = ShardSource(gateway.config.out_dir)

    def live(self) -> dict[str, dict[str, Any]]:
        policies = self.gateway.policies
        out = {}
        for sess in self.gateway.control.live():
            state = sess.summary()
            state["backend"] = policies.backend_of(sess.id)
            state.update(policies.queue_state(sess.id))
            out[sess.id] = state
        return out

    def advantages(self) -> dict[str, dict[str, Any]]:
        return self.shards.advantages()

    def summaries(self) -> list[dict[str, Any]]:
        rows = list(self.shards.summaries())
        store = self.gateway.store
        for sid in store.session_ids():
            rows += [_pending(r) for r in store.pending_rows(sid)]
        return rows

    def threads(self, session_id: str) -> list[dict[str, Any]]:
        pending = [_pending(r) for r in self.gateway.store.pending_rows(session_id)]
        return self.shards.threads(session_id) + pending

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        return self.shards.turns(session_id) + self.gateway.store.pending_turns(session_id)


def _pending(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row, pending=True)
    row["tokens"] = len(row.get("input_ids") or ())
    row["trained_tokens"] = int(sum(row.get("loss_mask") or ()))
    return row


class ViewerRoutes:
    """Answers ``/ui/...``. ``live``: the proxy's live sessions by id (None offline)."""

    def __init__(
        self,
        source: RowSource,
        decode: Decode,
        describe: str,
        live: Callable[[], dict[str, dict[str, Any]]] | None = None,
        tool_parser: str = "hermes",
        reasoning_parser: str = "qwen3",
    ) -> None:
        self.source = source
        self.decode = decode
        self.describe = describe
        self.live = live
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.router = self._router()
        # Other runs' folders, drawn over this one's (``?compare=``).
        self.others = OtherRuns()

    @staticmethod
    def is_page(path: str) -> bool:
        """The paths that answer without the token: the page, its scripts and its icon (no
        data)."""
        if path in (UI_PREFIX, f"{UI_PREFIX}/", ICON_PATH):
            return True
        return path.startswith(f"{UI_PREFIX}/") and path[len(UI_PREFIX) + 1 :] in STATIC

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path == ICON_PATH:
            if request.method not in ("GET", "HEAD"):
                return _error(405, f"agenttap viewer: {path} answers GET only")
            return _icon_response()
        if self.is_page(path):
            if path == UI_PREFIX:
                raise web.HTTPFound(f"{UI_PREFIX}/")
            name = path[len(UI_PREFIX) + 1 :] or "index.html"
            return web.Response(
                body=_static(name),
                content_type=STATIC[name],
                charset="utf-8",
                headers={"Cache-Control": "no-store"},
            )
        if request.method != "GET":
            return _error(405, f"agenttap viewer: {path} answers GET only")
        api_path = path.removeprefix(f"{UI_PREFIX}/api/").strip("/")
        match = None
        if path.startswith(f"{UI_PREFIX}/api/"):
            probe = request.clone(rel_url=request.rel_url.with_path(f"/{api_path}"))
            match = await self.router.resolve(probe)
        try:
            if match is not None and not isinstance(match, MatchInfoError):
                return await match.handler(request, *match.values())
        except ValueError as exc:
            return _error(400, f"agenttap viewer: {exc}")
        except LookupError as exc:
            return _error(404, f"agenttap viewer: {exc.args[0]}")
        return _error(
            404,
            f"agenttap viewer: no route {path}. It serves /ui/, /ui/api/sessions, /ui/api/run, "
            "/ui/api/groups/GROUP_ID, /ui/api/sessions/ID, /ui/api/sessions/ID/rows/THREAD_ID, "
            "/ui/api/sessions/ID/diff",
        )

    def _router(self) -> web.UrlDispatcher:
        """The data routes, under ``/ui/api/`` (matched without that prefix); each handler
        gets the request and the path's parts, in order."""
        router = web.UrlDispatcher()
        routes: list[tuple[str, Callable[..., Awaitable[web.StreamResponse]]]] = [
            ("/sessions", self._get_sessions),
            ("/run", self._get_run),
            ("/groups/{group_id}", self._get_group),
            ("/sessions/{id}", self._get_session),
            ("/sessions/{id}/rows/{thread_id}", self._get_tokens),
            ("/sessions/{id}/diff", self._get_diff),
        ]
        for path, handler in routes:
            router.add_route("GET", path, handler)
        return router

    async def _get_sessions(self, request: web.Request) -> web.Response:
        return await self._run(self._sessions, _list_query(request.query))

    async def _get_run(self, request: web.Request) -> web.Response:
        query = request.query
        return await self._run(self._run_view, query.get("by") or None, query.get("compare"))

    async def _get_group(self, request: web.Request, group_id: str) -> web.Response:
        return await self._run(self._group, group_id)

    async def _get_session(self, request: web.Request, sid: str) -> web.Response:
        return await self._run(self._session, sid)

    async def _get_tokens(self, request: web.Request, sid: str, tid: str) -> web.Response:
        offset = _int(request.query.get("offset", "0"), "offset")
        limit = _int(request.query.get("limit", str(viewer.PAGE_TOKENS)), "limit")
        overview = offset == 0 or request.query.get("overview") == "1"
        return await self._run(self._tokens, sid, tid, offset, limit, overview)

    async def _get_diff(self, request: web.Request, sid: str) -> web.Response:
        a, b = request.query.get("a", ""), request.query.get("b", "")
        if not a or not b:
            raise ValueError("diff wants ?a=REQUEST_ID&b=REQUEST_ID (two calls)")
        return await self._run(self._diff, sid, a, b)

    @staticmethod
    async def _run(fn: Callable[..., dict[str, Any]], *args: Any) -> web.Response:
        # Reading shards and decoding a page are blocking work: off the event loop, whose
        # other calls are streaming tokens meanwhile.
        result = await asyncio.to_thread(fn, *args)
        return web.json_response(result)

    def _live(self) -> dict[str, dict[str, Any]]:
        return self.live() if self.live is not None else {}

    def _all_sessions(self) -> list[dict[str, Any]]:
        return viewer.session_list(self.source.summaries(), self._live())

    def _sessions(self, query: dict[str, Any]) -> dict[str, Any]:
        sessions = self._all_sessions()
        page = viewer.query_sessions(sessions, **query)
        return page | {
            "source": self.describe,
            "live": self.live is not None,
            "keys": viewer.metadata_keys(sessions),
        }

    def _run_view(self, by: str | None, compare: str | None = None) -> dict[str, Any]:
        sessions = self._all_sessions()
        groups = viewer.group_list(sessions)
        step_s = viewer.trainer_step_times(self.source.advantages())
        view = viewer.run_summary(sessions, by, step_s) | {
            "source": self.describe,
            "keys": [k["key"] for k in viewer.metadata_keys(sessions)],
            "groups": groups[:GROUPS_SHOWN],
            "group_count": len(groups),
        }
        if compare:
            other = self.others.source(compare)
            summary = viewer.run_summary(
                viewer.session_list(other.summaries()),
                view["by"],
                viewer.trainer_step_times(other.advantages()),
            )
            view["compare"] = {
                "source": str(other.out_dir),
                "name": other.out_dir.name,
                "sessions": summary["sessions"],
                "steps": summary["steps"],
            }
        return view

    def _group(self, group_id: str) -> dict[str, Any]:
        summaries = self.source.summaries()
        sessions = viewer.session_list(summaries, self._live())
        return viewer.group_view(sessions, summaries, group_id, self.source.advantages())

    def _rows(self, sid: str) -> list[dict[str, Any]]:
        rows = self.source.threads(sid)
        if not rows and sid not in self._live():
            raise LookupError(
                f"no session {sid!r} here: it has no rows in the shards and is not live "
                f"(GET /ui/api/sessions lists them)"
            )
        return rows

    def _session(self, sid: str) -> dict[str, Any]:
        rows = self._rows(sid)
        summary = viewer.session_list(
            [viewer.row_node(r) | {"session_id": sid, "metadata": r.get("metadata")} for r in rows],
            {k: v for k, v in self._live().items() if k == sid},
        )
        return {
            "session": summary[0] if summary else {"id": sid},
            "tree": viewer.row_tree(rows),
            "calls": viewer.call_list(
                self.source.turns(sid), self.tool_parser, self.reasoning_parser
            ),
        }

    def _tokens(
        self, sid: str, tid: str, offset: int, limit: int, overview: bool
    ) -> dict[str, Any]:
        row = next((r for r in self._rows(sid) if r["thread_id"] == tid), None)
        if row is None:
            raise LookupError(f"session {sid!r} has no row {tid!r}")
        page = viewer.token_page(row, self.decode, offset, limit)
        if overview:
            page["overview"] = viewer.row_overview(row)
        return page

    def _diff(self, sid: str, a: str, b: str) -> dict[str, Any]:
        turns = {t["request_id"]: t for t in self.source.turns(sid)}
        missing = [r for r in (a, b) if r not in turns]
        if missing:
            raise LookupError(f"session {sid!r} has no call {missing[0]!r}")
        first, second = sorted(
            (turns[a], turns[b]), key=lambda t: (t.get("turn_index") or 0, t.get("started_at"))
        )
        return viewer.diff_calls(first, second, self.decode)


def live_viewer(gateway: GatewayCore) -> ViewerRoutes:
    """The viewer of a running proxy: its shards, its live sessions, its tokenizer."""
    source = LiveSource(gateway)
    config = gateway.config
    return ViewerRoutes(
        source,
        viewer.tokenizer_decoder(gateway.template.tokenizer),
        f"live proxy; shards in {Path(config.out_dir).resolve()}",
        live=source.live,
        tool_parser=config.tool_parser,
        reasoning_parser=config.reasoning_parser,
    )


def _icon_response() -> web.Response:
    return web.Response(
        body=icon(),
        content_type="image/x-icon",
        headers={"Cache-Control": "public, max-age=86400"},
    )


def _list_query(query: Any) -> dict[str, Any]:
    """The session list's query string as ``query_sessions``' arguments (a ValueError names
    what is wrong)."""
    filters = []
    for item in query.getall("filter", []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"filter wants KEY=VALUE (e.g. filter=trainer_step=3), not {item!r}")
        filters.append((key, value))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ValueError(f"order is asc or desc, not {order!r}")
    return {
        "sort": query.get("sort") or None,
        "descending": order == "desc",
        "filters": filters,
        "search": query.get("q", ""),
        "offset": _int(query.get("offset", "0"), "offset"),
        "limit": _int(query.get("limit", str(viewer.DEFAULT_PAGE)), "limit"),
    }


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {text!r}") from None


# -- offline: one command over a folder of shards ----------------------------------------------
def offline_app(routes: ViewerRoutes) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/":
            raise web.HTTPFound(f"{UI_PREFIX}/")
        if request.path == "/favicon.ico":
            return _icon_response()
        if request.path == UI_PREFIX or request.path.startswith(f"{UI_PREFIX}/"):
            return await routes.handle(request)
        return _error(404, "agenttap viewer: the page is at /ui/")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def serve_offline(
    routes: ViewerRoutes, host: str, port: int, ready: Callable[[str], Awaitable[None] | None]
) -> None:
    runner = web.AppRunner(offline_app(routes), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server: Any = site._server
    bound = server.sockets[0].getsockname()[1]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}{UI_PREFIX}/"
    maybe = ready(url)
    if maybe is not None:
        await maybe
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m capture.viewer_http",
        description="Browse captured trajectories: sessions, their rows, tokens and calls.",
    )
    parser.add_argument("out", type=Path, help="the proxy's output folder (agenttap_out)")
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="the policy's tokenizer folder (else ids)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0: any free port")
    parser.add_argument("--tool-parser", default="hermes")
    parser.add_argument("--reasoning-parser", default="qwen3")
    args = parser.parse_args(argv)
    if not (args.out / "threads").is_dir() and not (args.out / "turns").is_dir():
        print(
            f"agenttap viewer: {args.out} holds no threads/ or turns/ folder: give the folder "
            f"the proxy wrote (agenttap_out, e.g. agenttap-out).{nearby_outs(args.out)}",
            file=sys.stderr,
        )
        return 2
    decode = viewer.load_decoder(args.tokenizer)
    routes = ViewerRoutes(
        ShardSource(args.out),
        decode,
        f"shards in {args.out.resolve()}",
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
    )

    def ready(url: str) -> None:
        print(f"agenttap viewer: {url}  (shards in {args.out.resolve()}; Ctrl-C stops)", flush=True)

    try:
        asyncio.run(serve_offline(routes, args.host, args.port, ready))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"agenttap viewer: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
