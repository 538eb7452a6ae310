"""The control API's Python client (capture/control/api.py is plain HTTP: other processes and
languages call it directly): ``ControlClient`` with its bearer token, and ``AgentTapError`` for
a request the API refused (its status and message). ``AgentTap`` (capture/client/launcher.py)
drives an instance through it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pyarrow as pa

from capture.control.media import ARROW_STREAM


class AgentTapError(RuntimeError):
    """The control API refused a request (its status and message), or the proxy did not start."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ControlClient:
    """The control API over HTTP, with its bearer token."""

    def __init__(self, api_url: str, token: str, timeout: float = 120.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        arrow: bool = False,
        timeout: float | None = -1.0,
    ) -> tuple[dict[str, Any], pa.Table | None]:
        """(JSON answer, None), or (summary, table) with ``arrow``."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        if arrow:
            headers["Accept"] = ARROW_STREAM
        req = urllib.request.Request(self.api_url + path, data=data, method=method, headers=headers)
        try:
            wait = self.timeout if timeout is not None and timeout < 0 else timeout
            with urllib.request.urlopen(req, timeout=wait) as resp:
                raw = resp.read()
                if arrow and resp.headers.get("Content-Type", "").startswith(ARROW_STREAM):
                    table = pa.ipc.open_stream(raw).read_all()
                    meta = (table.schema.metadata or {}).get(b"agenttap_session", b"{}")
                    return json.loads(meta), table
                return json.loads(raw), None
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise AgentTapError(f"{method} {path}: {exc.code} {detail}", exc.code) from None

    def get(self, path: str) -> dict[str, Any]:
        return self.request("GET", path)[0]

    def post(self, path: str, body: Any = None) -> dict[str, Any]:
        return self.request("POST", path, body if body is not None else {})[0]
