"""Issue 14 item 1, fail closed, decided in-process: every option x every mistake (bad value,
no value, repeated, misspelled, a list; from --set or from config.yaml) stops the addon's
startup with an error naming the option, and the addon then refuses what an agent sends.

A real mitmdump per case (``tests/e2e/hostile/test_fail_closed.py`` did ~280) costs over a second of
CPU each just to import; here one mitmproxy master per case, in this process, goes through what
mitmdump's ``tools/main.py`` does with the same inputs, in its order: ``--set`` values with
``opts.set(..., defer=True)`` (agenttap's options are unknown until the script loads), then
config.yaml with ``optmanager.load``, then ``scripts`` set, so that mitmproxy's own
``ScriptLoader`` imports ``addons/capture.py``, calls ``load``, processes the deferred values and
calls ``configure``, as in mitmdump. What mitmdump would then do is read off that:

- it exits non-zero when anything logged an ERROR during startup (``addons/errorcheck.py``: the
  same ``ErrorCheckHandler`` is installed here), and that error must name the option;
- nothing leaves: a CONNECT to api.openai.com:443 and a plain-HTTP call with an API key, shown
  to the loaded script's addons as mitmproxy's proxy would, each get the addon's error answer.

The real-process test keeps one case per source and kind of mistake: it shows these verdicts
are the ones mitmdump reaches."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from mitmproxy import http, optmanager
from mitmproxy.addons import proxyserver, script
from mitmproxy.addons.errorcheck import ErrorCheckHandler
from mitmproxy.proxy.layers import http as http_layer
from mitmproxy.test import taddons, tflow, tutils

from capture.policy import startup
from rewriter.template import ChatTemplate
from tests.support.fail_closed_cases import (  # noqa: F401 (the test is collected here)
    cases,
    good_options,
    startup_inputs,
    test_every_option_is_in_the_matrix,
)
from tests.support.paths import CAPTURE
from tests.support.stub_vllm import StubPolicy

# A flow the addon neither answers nor refuses within this long is one it let through (a
# configuration it took for good waits for its gateway instead: see AgentTap._route).
FLOW_WAIT_S = 2.0
API_KEY = "sk-live-key"


@dataclass
class Started:
    """One mitmdump startup, in-process: what it logged at ERROR, and what became of the
    agent's requests shown to it afterwards."""

    errors: list[str]
    flows: dict[str, http.HTTPFlow | None] = field(default_factory=dict)  # None: held
    tap: Any = None  # the script's AgentTap
    gateway_port: int | None = None  # where it routed API calls (None: no gateway)


def _connect() -> http.HTTPFlow:
    """A CONNECT to an API host, with the session's credentials on it, as mitmproxy parses
    ``CONNECT api.openai.com:443``."""
    return tflow.tflow(
        req=tutils.treq(
            host="api.openai.com", port=443, method=b"CONNECT", scheme=b"",
            authority=b"api.openai.com:443", path=b"", content=b"",
            headers=http.Headers(host="api.openai.com:443",
                                 proxy_authorization="Basic c2Vzczp4"),
        )
    )  # fmt: skip


def _plain_call() -> http.HTTPFlow:
    """``GET http://api.openai.com/v1/models`` through the proxy, with an API key."""
    return tflow.tflow(
        req=tutils.treq(
            host="api.openai.com", port=80, method=b"GET", scheme=b"http",
            authority=b"api.openai.com", path=b"/v1/models", content=b"",
            headers=http.Headers(host="api.openai.com", authorization=f"Bearer {API_KEY}"),
        )
    )  # fmt: skip


async def _show(master: Any, flow: http.HTTPFlow, hooks: list[Any]) -> http.HTTPFlow | None:
    """Run ``flow`` through the master's addons hook by hook, as mitmproxy's HTTP layer does
    (the next hook unless the flow was killed; ``request`` follows ``requestheaders`` even when
    an addon answered there). None: an addon held it past FLOW_WAIT_S."""
    for hook in hooks:
        if flow.error is not None:
            break
        try:
            await asyncio.wait_for(master.addons.handle_lifecycle(hook(flow)), FLOW_WAIT_S)
        except TimeoutError:
            return None
    return flow


async def _start(sets: list[str], yaml_text: str | None, confdir: Path) -> Started:
    """mitmdump ``-s addons/capture.py`` with these ``--set`` values and config.yaml text, up to
    where it would exit or serve; then the agent's two requests."""
    errors = ErrorCheckHandler()
    errors.install()
    tctx = taddons.context(proxyserver.Proxyserver(), script.ScriptLoader())
    master, opts = tctx.master, tctx.options
    try:
        # mitmproxy/tools/main.py: --set (unknown names deferred), config.yaml, then the rest
        # of the command line, -s among it (the ScriptLoader starts loading the script).
        opts.set(f"confdir={confdir}", *sets, defer=True)
        if yaml_text is not None:
            optmanager.load(opts, yaml_text)
        opts.update(listen_host="127.0.0.1", listen_port=0, scripts=[str(CAPTURE)])
        # The script loads in its watcher task (load, deferred options, configure) once the
        # loop runs, as in mitmdump.
        loaded: ModuleType | None = None
        for _ in range(20):
            await asyncio.sleep(0)
            loaded = next((s.ns for s in master.addons.get("scriptloader").addons), None)
            if loaded is not None:
                break
        await asyncio.sleep(0)  # as ErrorCheck does, for the last records to come in
        started = Started([errors.format(r) for r in errors.has_errored])
        started.tap = getattr(loaded, "_tap", None)
        if not started.errors:
            # mitmdump runs on: its listener comes up, then `running` (the gateway starts).
            await master.addons.get("proxyserver").setup_servers()
            await master.running()
            started.errors = [errors.format(r) for r in errors.has_errored]
        # Served or not, the addon must not let the agent's requests through.
        started.flows["CONNECT"] = await _show(master, _connect(), [http_layer.HttpConnectHook])
        started.flows["GET"] = await _show(
            master,
            _plain_call(),
            [http_layer.HttpRequestHeadersHook, http_layer.HttpRequestHook],
        )
        gateway = getattr(started.tap, "gateway", None)
        started.gateway_port = gateway.port if gateway is not None else None
        return started
    finally:
        await master.addons.get("proxyserver").servers.update([])
        await master.done()  # the gateway stops, the script's watcher and the master's log go
        errors.uninstall()


def _leaked(started: Started) -> list[str]:
    """The agent's requests the addon did not refuse (or whose key it kept)."""
    leaked = []
    for name, flow in started.flows.items():
        if flow is None:
            leaked.append(f"{name} held")
        elif flow.response is None:
            leaked.append(f"{name} not answered" + (f" ({flow.error.msg})" if flow.error else ""))
        elif flow.response.status_code < 400:
            leaked.append(f"{name} answered {flow.response.status_code}")
        elif API_KEY in str(flow.request.headers) or "Proxy-Authorization" in flow.request.headers:
            leaked.append(f"{name} kept its key")
    return leaked


@pytest.fixture(scope="module")
def one_tokenizer_load() -> Iterator[None]:
    """The tokenizer is the same folder in every case: loaded once, not ~150 times (1.5 s each)
    by the startup check of each case whose other options pass (``check_startup``); the check
    itself, and its calls to the policy, run in every such case."""
    mp = pytest.MonkeyPatch()
    mp.setattr(startup, "ChatTemplate", functools.cache(ChatTemplate))
    yield
    mp.undo()


def test_the_good_options_start_and_serve(
    stub: StubPolicy, tmp_path: Path, one_tokenizer_load: None
) -> None:
    """The control: without a mistake nothing is logged at ERROR, the addon starts its gateway,
    and the same two requests are taken (routed to the gateway), not refused: a refusal in the
    matrix means something."""
    good = good_options(stub.url, tmp_path / "out")
    checks = len(stub.checks)
    started = asyncio.run(_start([f"{n}={v}" for n, v in good.items()], None, tmp_path))
    assert started.errors == []
    assert len(stub.checks) > checks  # the startup check did ask the policy
    assert started.tap is not None and started.tap.broken is None
    assert started.tap.settings is not None
    connect, get = started.flows["CONNECT"], started.flows["GET"]
    assert connect is not None and connect.response is None  # the tunnel is opened
    assert get is not None and get.metadata.get("agenttap_routed"), get and get.response
    assert started.gateway_port is not None
    assert (get.request.host, get.request.port) == ("127.0.0.1", started.gateway_port)


def _verdict(started: Started, expected: str) -> str:
    """The e2e test's verdicts, in its order: a request not refused (there: FORWARDED), no
    error (there: kept running, exit 0), an error without naming it, ok."""
    leaked = _leaked(started)
    if leaked:
        return f"LEAKS {leaked}"
    if not started.errors:
        return "no error logged (mitmdump keeps running)"
    text = "\n".join(started.errors)
    if expected not in text:
        return f"error without naming it: {text[-600:]}"
    return "ok"


def test_every_mistake_stops_startup_and_nothing_leaves(
    stub: StubPolicy, tmp_path: Path, one_tokenizer_load: None
) -> None:
    """Each case of the shared matrix, one fresh master each: an ERROR at startup that names
    the option (mitmdump exits non-zero saying so), and both requests refused."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    good = good_options(stub.url, tmp_path / "out")
    matrix = cases(a_file)

    async def decide() -> list[tuple[str, str, str, str]]:
        results = []
        for case in matrix:
            sets, yaml_text = startup_inputs(case, good)
            started = await _start(sets, yaml_text, tmp_path)
            results.append(
                (case.source, case.mistake, case.option, _verdict(started, case.expected))
            )
        return results

    results = asyncio.run(decide())
    print(f"\n{'source':<7} {'mistake':<11} {'option':<30} result")
    for source, mistake, option, verdict in results:
        print(f"{source:<7} {mistake:<11} {option:<30} {verdict[:100]}")
    failed = [r for r in results if r[3] != "ok"]
    assert not failed, "\n".join(" | ".join(r) for r in failed)
    assert len(results) >= 250
