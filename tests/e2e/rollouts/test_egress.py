"""A rollout's network (capture/egress.py, the sandbox's own network namespace): with
"egress": "none" (the default) its agent reaches the policy and nothing else; with "public" it
may open HTTPS tunnels through the proxy to public hosts (PyPI here, the one public host this
machine reaches), never to loopback or private addresses, nor the policy server. Real
mitmdump, real bwrap, a real TLS handshake with the public host's own certificate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from capture.client.launcher import AgentTap
from tests.support.stub_vllm import StubPolicy

# Opens a CONNECT tunnel through the session's proxy to each target and, where the proxy says
# 200, a TLS session verified by the system's CAs and one GET: the status line, or the refusal.
AGENT = r"""
import base64, http.client, json, os, socket, ssl, sys, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
auth = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
results = {}
for target in json.loads(sys.argv[-1])["targets"]:
    host, port = target.rsplit(":", 1)
    conn = http.client.HTTPSConnection(
        proxy.hostname, proxy.port, timeout=30,
        context=ssl.create_default_context(cafile="/etc/ssl/certs/ca-certificates.crt"),
    )
    conn.set_tunnel(host, int(port), headers={"Proxy-Authorization": f"Basic {auth}"})
    # The tunnel goes to the proxy by plain HTTP: HTTPSConnection's TLS starts after CONNECT.
    try:
        conn.request("GET", "/simple/pip/", headers={"Host": host})
        results[target] = conn.getresponse().status
    except OSError as exc:
        results[target] = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        conn.close()
open("report.json", "w").write(json.dumps(results))
"""


def run_agent(tap: AgentTap, egress: str | None, targets: list[str]) -> dict[str, object]:
    body: dict[str, object] = {
        "agent": {"command": [sys.executable, "-c", AGENT]},
        "prompt": json.dumps({"targets": targets}),
    }
    if egress is not None:
        body["egress"] = egress
    result = tap.client.request("POST", "/rollouts", body, timeout=None)[0]
    (run,) = result["rollouts"]
    report = Path(run["workdir"]) / "report.json"
    assert report.exists(), run
    return dict(json.loads(report.read_text()))


def test_egress_none_reaches_nothing_but_the_policy(stub_tap: AgentTap, stub: StubPolicy) -> None:
    stub_port = stub.url.rsplit(":", 1)[1].rstrip("/")
    got = run_agent(stub_tap, None, ["pypi.org:443", f"127.0.0.1:{stub_port}"])
    # The proxy refuses the CONNECT (403): no tunnel, no TLS.
    assert all("403" in str(v) for v in got.values()), got


def test_egress_public_reaches_public_hosts_only(stub_tap: AgentTap, stub: StubPolicy) -> None:
    stub_port = stub.url.rsplit(":", 1)[1].rstrip("/")
    # The policy's own port, spelled as IPv6 forms that carry 127.0.0.1 and as the numbers
    # the resolver reads (decimal, octal): refused by the number, whatever the spelling.
    closed = [
        f"127.0.0.1:{stub_port}",
        "localhost:443",
        "169.254.169.254:443",
        f"[::127.0.0.1]:{stub_port}",
        f"[::ffff:0:7f00:1]:{stub_port}",
        f"2130706433:{stub_port}",
        f"0177.0.0.1:{stub_port}",
    ]
    got = run_agent(stub_tap, "public", ["pypi.org:443", *closed])
    # PyPI answers through the tunnel, with its own certificate (verified by the system's CAs):
    # the proxy relays, it does not intercept.
    assert got["pypi.org:443"] == 200, got
    for target in closed:
        assert "403" in str(got[target]), (target, got)
