"""A stand-in for ``python -m vllm.entrypoints.openai.api_server ... --uds PATH``: answers
``GET /v1/models`` on the unix socket PATH until it is stopped. For tests of what
``python -m policy_server`` does around its vLLM (its private folder, its exit on SIGTERM), run
through a wrapper given as ``AGENTTAP_VLLM_PYTHON``; the real vLLM on that path:
tests/e2e/policy/test_run_proxy.py."""

from __future__ import annotations

import http.server
import json
import socketserver
import sys


class Answers(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"data": [{"id": "fake", "max_model_len": 4096}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:  # a unix socket's peer has no host
        return "unix"


class UnixHTTPServer(socketserver.UnixStreamServer):
    pass


if __name__ == "__main__":
    if "--uds" not in sys.argv:
        sys.exit(1)
    path = sys.argv[sys.argv.index("--uds") + 1]
    print(f"fake vLLM serving on {path}", flush=True)
    with UnixHTTPServer(path, Answers) as server:
        server.serve_forever()
