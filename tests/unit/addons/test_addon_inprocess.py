"""The addon's options and refusals in-process, through mitmproxy's own test harness (``taddons``):
no mitmdump, no sockets. The same rules ``tests/e2e/hostile/test_fail_closed.py`` checks end to end through a
real mitmdump, here fast and one by one."""

from __future__ import annotations

import asyncio
import json

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons, tflow

from addons.capture import AgentTap


def _loaded(**deferred: object) -> tuple[AgentTap, taddons.context]:
    """A fresh addon loaded into a test master whose ``--set`` / config.yaml values (the
    options mitmproxy does not know yet: deferred) are ``deferred``."""
    tap = AgentTap()
    tctx = taddons.context()
    for name, default in [("connection_strategy", "eager"), ("stream_large_bodies", "")]:
        if name not in tctx.options:  # declared by addons the test master does not load
            tctx.options.add_option(name, str, default, "")
    tctx.options.deferred.update(deferred)
    tctx.master.addons.add(tap)
    return tap, tctx


def test_values_are_parsed_into_one_typed_settings() -> None:
    tap, tctx = _loaded(agenttap_idle_timeout="30", agenttap_responses_websocket="off")
    with tctx:
        tctx.configure(tap)
        assert tap.broken is None
        assert tap.settings is not None
        assert tap.settings.idle_timeout_s == 30
        assert "api.openai.com" in tap.hosts
        # Bodies past the limit are streamed to the gateway, never held whole.
        assert tctx.options.stream_large_bodies == str(tap.settings.max_body_bytes)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("agenttap_responses_websocket", "no-thanks"),  # a bool that is not one
        ("agenttap_hosts", None),  # a text option with no value
        ("agenttap_idle_timeout", None),
        ("agenttap_idle_timeout", "abc"),
        ("agenttap_idle_timeout", ["30", "40"]),  # given twice
        ("agenttap_idle_timout", "30"),  # misspelled
    ],
)
def test_a_bad_value_at_startup_refuses_every_flow(name: str, value: object) -> None:
    tap, tctx = _loaded(**{name: value})
    with tctx:
        tctx.configure(tap)
        assert tap.broken is not None and name.split("_tim")[0] in tap.broken
        for flow in (tflow.tflow(), tflow.tflow()):
            flow.request.host = "api.openai.com"
            asyncio.run(tap.request(flow))
            assert flow.response is not None and flow.response.status_code == 503
            assert (
                "agenttap is not running" in json.loads(flow.response.content)["error"]["message"]
            )
            assert not flow.metadata.get("agenttap_routed")


def test_a_bad_value_while_running_is_refused_and_the_old_one_stays() -> None:
    tap, tctx = _loaded(agenttap_idle_timeout="30")
    with tctx:
        tctx.configure(tap)
        tap._running = True  # configure's runtime path: mitmproxy undoes a refused change
        with pytest.raises(exceptions.OptionsError, match="agenttap_idle_timeout"):
            tctx.configure(tap, agenttap_idle_timeout="-1")
        assert tap.settings is not None and tap.settings.idle_timeout_s == 30


def test_hosts_that_are_not_api_hosts_are_refused_not_forwarded() -> None:
    tap, tctx = _loaded()
    with tctx:
        tctx.configure(tap)
        flow = tflow.tflow()
        flow.request.host = "example.com"
        flow.request.headers["Authorization"] = "Bearer sk-secret"
        asyncio.run(tap.request(flow))
        assert flow.response is not None and flow.response.status_code == 403
        assert "Authorization" not in flow.request.headers  # stripped before it is logged


def test_connect_to_another_host_is_refused_and_its_keys_stripped() -> None:
    tap, tctx = _loaded()
    with tctx:
        tctx.configure(tap)
        flow = tflow.tflow()
        flow.request.method = "CONNECT"
        flow.request.host = "example.com"
        flow.request.headers["Proxy-Authorization"] = "Basic c2Vzc2lvbjp4"
        asyncio.run(tap.http_connect(flow))
        assert flow.response is not None and flow.response.status_code == 403
        assert "Proxy-Authorization" not in flow.request.headers


def test_call_lines_skip_the_deprecated_add_log_hook_only() -> None:
    """The per-call lines, and the connection handler's informational lines, go to every log
    handler but mitmproxy's LegacyLogEvents (which walks every addon per record for a hook none
    implements); other records, the connection handler's warnings included, still reach it."""
    import logging

    from mitmproxy.log import LegacyLogEvents

    from addons.log_filters import skip_legacy_log_events
    from capture.pipeline.turn import call_logger

    _loaded()
    legacy = [h for h in logging.getLogger().handlers if isinstance(h, LegacyLogEvents)]
    assert legacy, "mitmproxy's master installs LegacyLogEvents"
    call = call_logger.makeRecord(call_logger.name, logging.INFO, __file__, 1, "call", (), None)
    other = logging.getLogger("capture.gateway").makeRecord(
        "capture.gateway", logging.INFO, __file__, 1, "other", (), None
    )
    server = logging.getLogger("mitmproxy.proxy.server")
    streaming = server.makeRecord(
        server.name, logging.INFO, __file__, 1, "Streaming response from 127.0.0.1.", (), None
    )
    warning = server.makeRecord(server.name, logging.WARNING, __file__, 1, "x", (), None)
    for handler in legacy:
        assert not handler.filter(call)
        assert not handler.filter(streaming)
        assert handler.filter(other)
        assert handler.filter(warning)
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    collect = Collect()
    logging.getLogger().addHandler(collect)
    try:
        call_logger.handle(call)  # as logging does once the level lets it through
    finally:
        logging.getLogger().removeHandler(collect)
    assert seen == ["call"]
    skip_legacy_log_events()  # a reloaded script: still one filter
    assert all(sum(type(f).__name__ == "_NotCallLines" for f in h.filters) == 1 for h in legacy)
