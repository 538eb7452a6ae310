"""Test-only mitmproxy script: logs every server connection mitmproxy opens and kills any that is
not to loopback, so a recording or replay can prove (and can never break) "nothing is dialed out".
Load it after the capture addon: ``mitmdump -s addons/capture.py -s tests/support/dial_guard.py``."""

from __future__ import annotations

import ipaddress
import logging

from mitmproxy.proxy import server_hooks

logger = logging.getLogger(__name__)
MARK = "dial-guard:"


class DialGuard:
    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        host, port = data.server.address or ("?", 0)
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        logger.warning("%s %s %s:%s", MARK, "loopback" if loopback else "REFUSED", host, port)
        if not loopback:
            data.server.error = f"dial guard: {host}:{port} is not loopback"


addons = [DialGuard()]
