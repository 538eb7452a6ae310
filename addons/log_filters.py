"""What the addon trims from mitmproxy's own logging: the dumper prints WebSocket messages only
at a higher ``flow_detail``, and the per-call lines (``agenttap call:``) and mitmproxy's own
per-connection and per-stream lines skip the deprecated ``add_log`` hook. Both are set up once,
in the main addon's ``load``."""

from __future__ import annotations

import logging
from typing import Any

from mitmproxy import http
from mitmproxy.log import LegacyLogEvents

from capture.pipeline.turn import call_logger

# mitmproxy's dumper prints each WebSocket message from this flow_detail on (below it, the
# Responses WebSocket's dozens of messages per call would bury the one ``agenttap call:`` line).
WEBSOCKET_MESSAGES_DETAIL = 3


def quiet_websocket_messages(master: Any) -> None:
    """Make mitmproxy's dumper print WebSocket messages only at flow_detail >= 3. mitmproxy
    looks an addon's hook up by name on every event, so the instance attribute set here is what
    it calls; done once per dumper (a reloaded script finds it done)."""
    dumper = master.addons.get("dumper")
    if dumper is None or "websocket_message" in vars(dumper):
        return
    original = dumper.websocket_message

    def websocket_message(flow: http.HTTPFlow) -> None:
        if master.options.flow_detail >= WEBSOCKET_MESSAGES_DETAIL:
            original(flow)

    dumper.websocket_message = websocket_message


# mitmproxy's connection handler: "client connect", "server connect", "Streaming response from
# ..." (one per streamed answer), their disconnects; its warnings and errors still go.
CONNECTION_LOGGER = "mitmproxy.proxy.server"


class _NotCallLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if name == CONNECTION_LOGGER:
            return record.levelno >= logging.WARNING
        return name != call_logger.name


def skip_legacy_log_events() -> None:
    """mitmproxy hands every log record to its deprecated ``add_log`` hook as well: a walk over
    every addon, after a wake-up of the event loop through its self-pipe, per record, when no
    addon of mitmproxy's own implements it. The per-call lines (``agenttap call:``) and the
    connection handler's informational lines (a streamed answer's "Streaming response from",
    connects and disconnects: two or three per call) skip that hook; the terminal, mitmweb's
    event log and every other handler still get them."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, LegacyLogEvents) and not any(
            isinstance(f, _NotCallLines) for f in handler.filters
        ):
            handler.addFilter(_NotCallLines())
