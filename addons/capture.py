"""agenttap's mitmproxy addon: ``mitmdump -s addons/capture.py --set agenttap_tokenizer=...``.

Glue only. Calls to the intercepted API hosts are pointed at the gateway (a loopback server in
this same event loop, see ``capture/gateway.py``) which answers them from the policy and records
them; every other destination is refused with a 403 and never tunnelled out. Client API keys are
removed from the flow before anything else sees it. The gateway is started and announced by
``addons/gateway_start.py``; calls answered whole are answered in-process by
``addons/in_process.py``.

Saved flows (``mitmdump -w FILE``) show the client's original request
(``https://api.openai.com/...``), without the gateway's headers or the client's credentials, and
carry the session id in ``flow.metadata["agenttap_session"]``; so
``mitmdump -n -C FILE -s addons/capture.py --set ...`` replays them through the policy again,
offline (see ``tests/support/flows.py``)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

# mitmproxy puts this script's folder first on sys.path, where this file would shadow the
# `capture` package; drop it, and make the repository importable when it is not installed.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.append(str(_HERE.parent))

from mitmproxy import connection, ctx, exceptions, http, optmanager, tcp, tls  # noqa: E402
from mitmproxy.addonmanager import Loader  # noqa: E402
from mitmproxy.proxy import server_hooks  # noqa: E402

from addons.client_timeouts import ClientTimeouts  # noqa: E402
from addons.control_host import ControlHost  # noqa: E402
from addons.credentials import proxy_credentials, strip_secrets  # noqa: E402
from addons.gateway_start import announce_ready, announce_start, start_gateway  # noqa: E402
from addons.in_process import InProcessAnswers  # noqa: E402
from addons.log_filters import quiet_websocket_messages, skip_legacy_log_events  # noqa: E402
from capture.egress import EgressRefused, public_address  # noqa: E402
from capture.gateway import Gateway  # noqa: E402
from capture.heap import settle_heap  # noqa: E402
from capture.logs.escape import printable  # noqa: E402
from capture.options import Settings, all_options, parse_settings  # noqa: E402
from capture.options.reading import check_deferred, unknown_names  # noqa: E402
from capture.options.values import passes_through  # noqa: E402
from capture.pipeline.bodies import OVERSIZED_HEADER, shrink_head  # noqa: E402
from capture.pipeline.handoff import (  # noqa: E402
    CONTROL_HOST,
    caller,
    mark_for_gateway,
    unmark_for_gateway,
)
from capture.policy.startup import check_startup  # noqa: E402
from rewriter.template import ChatTemplate  # noqa: E402

logger = logging.getLogger(__name__)

# Plain-HTTP requests through the proxy to CONTROL_HOST (http://agenttap.local) reach the control
# API (capture/control/api.py), with its token like every control route.
# How long a request waits for the gateway to come up (a client replay starts sending at once).
GATEWAY_WAIT_S = 60.0


class AgentTap:
    def __init__(self) -> None:
        self.gateway: Gateway | None = None
        # client connection id -> proxy username and password given on its CONNECT
        self._tunnel_sessions: dict[str, tuple[str, str]] = {}
        # Client connections whose tunnel goes to a public host (a rollout's "egress":
        # "public"), and the address it was pinned to.
        self._egress: dict[str, str] = {}
        self._options = {o.name: o for o in all_options()}
        # Every option, parsed (capture/options/); None until configure has read them.
        self.settings: Settings | None = None
        # Set when `running` has started the gateway, or given up on it.
        self._ready = asyncio.Event()
        self._running = False
        # Option values that could not be read when the addon loaded (kept: those values never
        # reach mitmproxy, so no later configure can clear them).
        self._load_error: str | None = None
        # Why the configuration cannot be used; while set, every flow is refused.
        self.broken: str | None = None
        # The startup check of the policy servers (capture/policy/startup.py): done once; its
        # verdict.
        self._policy_checked = False
        self._startup_error: str | None = None
        self._template: ChatTemplate | None = None

    def _passes(self, host: str | None) -> bool:
        """``host`` is one the user let through (agenttap_passthrough): tunnelled or forwarded
        unchanged, never answered nor recorded. Never while the configuration is broken."""
        if not host or self.settings is None or self.broken:
            return False
        return passes_through(host, self.settings.passthrough)

    @property
    def hosts(self) -> frozenset[str]:
        return self.settings.hosts if self.settings is not None else frozenset()

    def load(self, loader: Loader) -> None:
        # Declared as text, whatever they hold: see capture/options/__init__.py for why.
        for option in self._options.values():
            loader.add_option(option.name, str, option.default, option.help)
        # Offline, mitmproxy must not dial the real host on CONNECT. The proxy username names the
        # session; we read it ourselves rather than turn on proxyauth, whose 407 would lock out
        # clients configured without credentials. A proxyauth the user sets still applies.
        loader.master.options.update(connection_strategy="lazy")
        quiet_websocket_messages(loader.master)
        skip_legacy_log_events()
        self._take_deferred(loader.master.options)

    def _take_deferred(self, options: optmanager.OptManager) -> None:
        """mitmproxy applies ``--set`` and ``config.yaml`` values of a script's options right
        after its ``load``, with its own parsing; a value it cannot take there (a name given
        twice, a text option with no value, a YAML number for a text option) makes it skip this
        addon and run as an open forwarding proxy. So read them here first: each becomes one
        checked text, or an error that refuses every flow (and, logged at startup, makes
        mitmdump exit non-zero)."""
        problems = check_deferred(options.deferred, self._options)
        if problems:
            self._load_error = self.broken = "; ".join(problems)
            for problem in problems:
                logger.error("%s", problem)

    def configure(self, updated: set[str]) -> None:
        if self.settings is not None and not updated & self._options.keys():
            return
        try:
            unknown = unknown_names(ctx.options.deferred, self._options)
            if unknown:
                raise ValueError(unknown)
            settings = parse_settings({n: getattr(ctx.options, n) for n in self._options})
        except ValueError as exc:
            # Never run as a plain forwarding proxy with a configuration we could not read:
            # every flow is refused from here on.
            self.broken = str(exc)
            if not self._running:
                logger.error("%s", exc)  # at startup: mitmdump exits non-zero
                return
            raise exceptions.OptionsError(str(exc)) from None  # later: the change is undone
        self.settings = settings
        if not self._running and not self._policy_checked:
            self._policy_checked = True
            self._template, self._startup_error = check_startup(settings)
            if self._startup_error:
                logger.error("%s", self._startup_error)  # mitmdump exits non-zero
        self.broken = self._load_error or self._startup_error
        # Bodies over the limit are streamed to the gateway, which refuses them after reading
        # the limit: mitmproxy never holds a 400 MB body in memory.
        limit = str(settings.max_body_bytes)
        if ctx.options.stream_large_bodies != limit:
            ctx.options.update(stream_large_bodies=limit)
        if self.gateway is not None and updated & {
            "agenttap_policy_url",
            "agenttap_tokenizer",
            "agenttap_out",
        }:
            logger.warning("agenttap: policy, tokenizer and output changes apply after a restart")

    async def running(self) -> None:
        self._running = True
        try:
            await self._start_gateway()
        finally:
            self._ready.set()
        if self.gateway is not None:
            await announce_ready(self.gateway, self.hosts)

    async def _start_gateway(self) -> None:
        settings = self.settings
        if settings is None or self.broken:
            return  # every flow is refused; the error was logged
        if not settings.policy_urls or settings.tokenizer is None:
            logger.error(
                "agenttap: set agenttap_policy_url and agenttap_tokenizer "
                "(or start through scripts/run_proxy.sh); API calls get 503 until then"
            )
            return
        gateway = await start_gateway(settings, self._template)
        self.gateway = gateway
        # Start-up's objects (tokenizer, templates, schemas) live as long as the process: out of
        # the collector's sight from here on (capture/heap.py). Before the banner: its full
        # collection takes a moment, and "agenttap ready:" follows the banner at once.
        settle_heap()
        announce_start(gateway, self.hosts)

    async def done(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway = None

    # -- flows -------------------------------------------------------------------------------
    def _refuse(self, flow: http.HTTPFlow, host: str) -> None:
        flow.response = http.Response.make(
            403,
            f"agenttap: {host} is not an intercepted API host; this proxy only answers "
            f"{', '.join(sorted(self.hosts))} and sends nothing out.\n",
            {"Content-Type": "text/plain"},
        )

    def _refuse_broken(self, flow: http.HTTPFlow) -> bool:
        """With a configuration that could not be read, nothing is forwarded, ever."""
        if self.broken is None:
            return False
        flow.response = http.Response.make(
            503,
            json.dumps({"error": {"message": f"agenttap is not running: {self.broken}",
                                  "type": "server_error"}}).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        return True

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        # The CONNECT is logged too (flow_detail >= 2 prints its headers): keys go first. A
        # proxyauth the user set has read its credentials already (it runs before scripts).
        user, password = proxy_credentials(flow.request.headers.get("Proxy-Authorization"))
        strip_secrets(flow.request)
        if flow.response or self._refuse_broken(flow):
            return  # proxyauth's 407
        host = flow.request.host.lower()
        if host not in self.hosts:
            if not self._passes(host) and not await self._public_egress(flow, user, password):
                self._refuse(flow, host)
            return
        if user:
            # The requests inside this tunnel are flows of their own on the same connection.
            self._tunnel_sessions[flow.client_conn.id] = (user, password)

    async def _public_egress(self, flow: http.HTTPFlow, user: str | None, password: str) -> bool:
        """A CONNECT of a session whose rollout asked for ``"egress": "public"``, with that
        session's secret, to a host whose every address is public: pinned to its address (the
        one checked is the one dialled) and relayed unread, like a passthrough host."""
        gateway = self.gateway
        if gateway is None or not user or user not in gateway.egress_public:
            return False
        if gateway.control.credential_refusal(user, [password], required=True) is not None:
            return False
        bound = _bound(gateway, flow.client_conn)
        if bound is not None and bound != user:
            return False  # a sandbox tunnels as its own session only
        host, port = flow.request.host, flow.request.port
        try:
            address = await public_address(host, port)
        except EgressRefused as exc:
            # The user is a rollout's session (ids are a safe charset); the host is the agent's.
            logger.warning(
                "agenttap: session %s: a tunnel to %s refused: %s", user, printable(host), exc
            )
            return False
        self._egress[flow.client_conn.id] = address
        flow.request.host = address  # mitmproxy dials what the request names after this hook
        return True

    def _egress_to(self, client: connection.Client, address: object) -> bool:
        """``address`` is the public host ``client``'s tunnel was pinned to."""
        pinned = self._egress.get(client.id)
        return pinned is not None and isinstance(address, tuple) and address[0] == pinned

    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        # A passthrough host's TLS is never intercepted: its bytes are relayed as they are.
        address = data.context.server.address
        if address and (self._passes(address[0]) or self._egress_to(data.context.client, address)):
            data.ignore_connection = True

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        # The only server mitmproxy may connect to is the gateway, or a passthrough host:
        # whatever else would open a connection (a raw tunnel, a flow we did not route) never
        # reaches the network.
        address = data.server.address
        if self.gateway is not None and address == ("127.0.0.1", self.gateway.port):
            return
        if address and (self._passes(address[0]) or self._egress_to(data.client, address)):
            return
        host, port = address or ("?", 0)
        data.server.error = f"agenttap: {host}:{port} is not dialed; only the policy answers here"

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        # A tunnel to an API host that does not carry TLS (or HTTP) would be relayed as raw TCP
        # to the real host: close it instead. Nothing but the policy answers here. A passthrough
        # host's tunnel is relayed (its TLS, not intercepted, arrives here as raw bytes).
        address = flow.server_conn.address
        if address and (self._passes(address[0]) or self._egress_to(flow.client_conn, address)):
            return
        logger.warning(
            "agenttap: closed a tunnel from %s that is not TLS or HTTP (raw bytes are never "
            "relayed)",
            flow.client_conn.peername[0] if flow.client_conn.peername else "?",
        )
        flow.kill()

    def client_disconnected(self, client: connection.Client) -> None:
        self._tunnel_sessions.pop(client.id, None)
        self._egress.pop(client.id, None)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        """Route API calls to the gateway as soon as their headers are in: a body over
        agenttap_max_body_bytes is then streamed (mitmproxy's stream_large_bodies, set from it;
        a chunked one switches to streaming midway) to the gateway, which refuses it with the
        provider's 413 after reading no more than the limit. Nothing is held whole in memory.
        Flows that never pass through here (client replay) are routed in ``request``."""
        host = flow.request.pretty_host.lower()
        if not flow.response and host not in self.hosts and self._passes(host):
            flow.request.headers.pop("Proxy-Authorization", None)  # ours, not the host's
            return  # forwarded unchanged
        if flow.response or host == CONTROL_HOST or host not in self.hosts or self.broken:
            strip_secrets(flow.request)  # a refused flow is logged and saved too
            if flow.request.stream:
                flow.kill()  # a streamed request cannot be answered here; nothing goes out
            return
        await self._route(flow)
        if flow.request.stream and (
            flow.response is not None or not flow.metadata.get("agenttap_routed")
        ):
            flow.response = None
            flow.kill()

    async def request(self, flow: http.HTTPFlow) -> None:
        if not flow.metadata.get("agenttap_routed"):
            await self._route(flow)  # not seen in requestheaders: a client replay
        # A routed call whose body is whole is answered next, in-process (addons/in_process.py).

    async def _route(self, flow: http.HTTPFlow) -> None:
        """Point an API call at the gateway (or refuse it, or let a passthrough host's through),
        its credentials stripped and its session tagged."""
        host = flow.request.pretty_host.lower()
        if not flow.response and host not in self.hosts and self._passes(host):
            flow.request.headers.pop("Proxy-Authorization", None)
            return  # forwarded unchanged: the agent's own tools, never recorded
        # Keys go before anything else, refusals included: every flow is logged and can be saved.
        plain_user, plain_password = proxy_credentials(
            flow.request.headers.get("Proxy-Authorization")
        )
        strip_secrets(flow.request)
        if flow.response or self._refuse_broken(flow):
            return
        host = flow.request.pretty_host.lower()
        if host not in self.hosts:
            self._refuse(flow, host)
            return
        if self.gateway is None and not self._ready.is_set():
            # A client replay (-C) sends its first request while the gateway is still starting.
            try:
                await asyncio.wait_for(self._ready.wait(), GATEWAY_WAIT_S)
            except TimeoutError:
                pass
        if self.gateway is None:
            flow.response = http.Response.make(
                503,
                b'{"error": {"message": "agenttap is not configured: no policy server", '
                b'"type": "server_error", "param": null, "code": null}}',
                {"Content-Type": "application/json"},
            )
            return
        session_id, secret = caller(
            flow.metadata.get("proxyauth"),
            self._tunnel_sessions.get(flow.client_conn.id),
            plain_user,
            plain_password,
            # a replayed flow keeps the session it was recorded under
            flow.metadata.get("agenttap_session"),
        )
        req = flow.request
        # Put back by _restore before the flow is saved or shown.
        flow.metadata["agenttap_origin"] = [
            req.scheme,
            req.host,
            req.port,
            req.authority,
            req.headers.get("Host"),
        ]
        flow.metadata["agenttap_host"] = host
        flow.metadata["agenttap_session"] = session_id
        shrunk = shrink_head(req.path, list(req.headers.fields))
        if shrunk is not None:
            # Too large for the gateway to read: it is sent only framing and this mark, and
            # answers with the provider's 431.
            req.path, fields, note = shrunk
            req.headers = http.Headers(fields)
            req.headers[OVERSIZED_HEADER] = note
        mark_for_gateway(
            req.headers,
            token=self.gateway.token,
            session_id=session_id,
            secret=secret,
            host=host,
            bound=_bound(self.gateway, flow.client_conn),
        )
        req.scheme = "http"
        req.host = "127.0.0.1"
        req.port = self.gateway.port
        req.headers["Host"] = host
        flow.metadata["agenttap_routed"] = True

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if (
            "agenttap_host" in flow.metadata
            and flow.response is not None
            and not flow.metadata.get("agenttap_in_process")
        ):
            flow.response.stream = True

    @staticmethod
    def _restore(flow: http.HTTPFlow) -> None:
        """Show the request as the client sent it (its original URL, no gateway headers) and drop
        the proxy credentials. Script addons run before mitmproxy's ``save`` addon, so this
        happens before ``-w`` / ``save_stream_file`` writes the flow."""
        flow.metadata.pop("proxyauth", None)
        # A saved flow replays as the client sent it: routed again, from the start.
        flow.metadata.pop("agenttap_routed", None)
        flow.metadata.pop("agenttap_in_process", None)
        origin = flow.metadata.get("agenttap_origin")
        if not origin:
            return
        scheme, host, port, authority, host_header = origin
        req = flow.request
        unmark_for_gateway(
            req.headers, answered=flow.response is not None and flow.response.status_code < 400
        )
        req.scheme = scheme
        req.host = host
        req.port = port
        req.authority = authority
        if host_header is None:
            req.headers.pop("Host", None)
        else:
            req.headers["Host"] = host_header

    def response(self, flow: http.HTTPFlow) -> None:
        # The gateway's secret must not end up in a saved flow file.
        self._restore(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._restore(flow)


def _bound(gateway: Gateway, client: connection.Client) -> str | None:
    """The rollout session ``client``'s connection is bound to (it came through that run's
    bridge: capture/control/bindings.py); None: it did not."""
    return gateway.bindings.session_for(client.peername, client.sockname)


def _client_timeout(tap: AgentTap) -> float | None:
    return tap.settings.client_timeout_s if tap.settings is not None else None


_tap = AgentTap()
# ControlHost first: it reads a control call's bearer token before the tap strips credentials.
# ClientTimeouts before the tap: its clock stops (``request``) before InProcessAnswers's
# ``request`` hook answers a buffered call in-process, which takes as long as the policy does.
# InProcessAnswers after the tap: it answers what the tap's ``request`` hook routed.
addons = [
    ControlHost(lambda: _tap.gateway),
    ClientTimeouts(lambda: _client_timeout(_tap)),
    _tap,
    InProcessAnswers(lambda: _tap.gateway),
]
