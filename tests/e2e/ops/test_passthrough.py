"""agenttap_passthrough: hosts the agent's own tools need (package indexes, git hosts) are
tunnelled or forwarded unchanged, never intercepted nor recorded; every other host is still
refused, and a pattern that would let an API host through stops the proxy. Stand-ins for those
hosts run on loopback: a plain HTTP server, and a TLS server with a self-signed certificate
that a client can only verify if the proxy does not intercept its TLS."""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from capture.control.endpoints import Endpoints
from policy_server.launcher import free_port
from tests.support.proxies import Proxy, start_proxy
from tests.support.stub_vllm import StubPolicy


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        body = f"hello from the real host; proxy auth seen: {'Proxy-Authorization' in self.headers}"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


def self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = folder / "real.pem", folder / "real.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def serve(tls: tuple[Path, Path] | None) -> tuple[int, http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", free_port()), Hello)
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1], server


@pytest.fixture(scope="module")
def real_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, Path]]:
    cert, key = self_signed(tmp_path_factory.mktemp("real"))
    plain_port, plain = serve(None)
    tls_port, tls = serve((cert, key))
    yield plain_port, tls_port, cert
    plain.shutdown()
    tls.shutdown()


@pytest.fixture(scope="module")
def pass_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    out = tmp_path_factory.mktemp("passthrough") / "out"
    proxy = start_proxy(stub.url, out, confdir, extra=["--set", "agenttap_passthrough=localhost"])
    yield proxy
    proxy.stop()


def fetch(proxy: Proxy, url: str, cafile: Path | None = None) -> tuple[int, str]:
    proxies = {
        "http": f"http://sess:x@127.0.0.1:{proxy.port}",
        "https": f"http://sess:x@127.0.0.1:{proxy.port}",
    }
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler(proxies)]
    if cafile is not None:
        handlers.append(
            urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=str(cafile)))
        )
    try:
        with urllib.request.build_opener(*handlers).open(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_passthrough_hosts_are_forwarded_and_tunnelled_unchanged(
    pass_proxy: Proxy, real_hosts: tuple[int, int, Path]
) -> None:
    plain_port, tls_port, cert = real_hosts
    status, body = fetch(pass_proxy, f"http://localhost:{plain_port}/x")
    assert status == 200 and body.startswith("hello from the real host")
    assert body.endswith("proxy auth seen: False")  # the session's username stays with us
    # The client verifies the real host's own certificate: the proxy did not intercept TLS.
    status, body = fetch(pass_proxy, f"https://localhost:{tls_port}/x", cafile=cert)
    assert status == 200 and body.startswith("hello from the real host")
    # Both went through the proxy (its log shows them), and nothing of them was recorded.
    log = pass_proxy.log.read_text(errors="replace")
    assert f"localhost:{plain_port}" in log and f"localhost:{tls_port}" in log
    assert pass_proxy.flush() == []


def test_other_hosts_stay_refused(pass_proxy: Proxy, real_hosts: tuple[int, int, Path]) -> None:
    plain_port, tls_port, cert = real_hosts
    status, body = fetch(pass_proxy, f"http://127.0.0.1:{plain_port}/x")
    assert status == 403 and "not an intercepted API host" in body
    with pytest.raises(OSError):
        fetch(pass_proxy, f"https://127.0.0.1:{tls_port}/x", cafile=cert)


def test_the_session_ca_bundle_trusts_real_sites_and_the_proxy(pass_proxy: Proxy) -> None:
    bundle = pass_proxy.ca.with_name("agenttap-ca-bundle.pem")
    text = bundle.read_text()
    assert pass_proxy.ca.read_text().strip() in text
    assert text.count("BEGIN CERTIFICATE") > 50  # the system's CAs too
    env = Endpoints("http://h:1", "http://h:2", str(pass_proxy.ca), str(bundle)).env("s")
    assert env["SSL_CERT_FILE"] == env["PIP_CERT"] == env["GIT_SSL_CAINFO"] == str(bundle)
    assert env["NODE_EXTRA_CA_CERTS"] == str(pass_proxy.ca)  # Node adds it to its own
