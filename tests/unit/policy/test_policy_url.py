"""Policy URLs (rewriter/policy_url.py): ``http://HOST:PORT`` or ``unix:/PATH`` (a vLLM served
with ``--uds``), as the options read them, and every reader of the URL reaching a server on a
unix socket: the vLLM client, the pools' health checks and weight labels, the start-up check.
The dev-mode probe (capture/policy/startup.py) finds a server whose /pause answers anyone."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from capture.options import parse_settings
from capture.options.values import parse_model_map, parse_urls
from capture.policy.pools import PolicyPools
from capture.policy.startup import check_policy, open_dev_routes, warn_if_exposed
from policy_server import launcher
from rewriter.canonical import SamplingParams
from rewriter.policy_url import (
    MAX_SOCKET_PATH_BYTES,
    UNIX_HTTP_BASE,
    connector,
    parse_policy_url,
    urlopen,
)
from rewriter.template import ChatTemplate
from rewriter.vllm_client import VLLMClient
from tests.support.paths import QWEN3
from tests.support.stub_vllm import StubPolicy


# -- the spelling -------------------------------------------------------------------------------
def test_a_unix_url_names_the_socket_and_requests_go_to_localhost() -> None:
    addr = parse_policy_url(" unix:/tmp/agenttap-x/vllm.sock ")
    assert addr.url == "unix:/tmp/agenttap-x/vllm.sock"
    assert addr.socket_path == "/tmp/agenttap-x/vllm.sock"
    assert addr.http_url("/v1/models") == f"{UNIX_HTTP_BASE}/v1/models"


def test_a_tcp_url_is_as_before() -> None:
    addr = parse_policy_url("http://127.0.0.1:8000/")
    assert addr.socket_path is None
    assert addr.http_url("/health") == "http://127.0.0.1:8000/health"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("unix:vllm.sock", "absolute path"),
        ("unix://localhost/tmp/vllm.sock", "absolute path"),
        ("unix:/tmp/a,b/vllm.sock", "comma"),
        ("unix:/tmp/a|b/vllm.sock", "comma, a |"),
        ("unix:/" + "x" * MAX_SOCKET_PATH_BYTES, "more than the 107"),
        ("ftp://127.0.0.1:8000", "unix:/path/to/vllm.sock"),
        ("/tmp/vllm.sock", "is not a policy URL"),
        ("http://127.0.0.1:99999", "bad port"),
    ],
)
def test_other_spellings_are_refused_saying_what_to_write(text: str, said: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_policy_url(text)
    assert said in str(err.value)


def test_the_options_take_unix_urls_in_lists_and_the_model_map() -> None:
    assert parse_urls("unix:/run/a/vllm.sock, http://127.0.0.1:8000") == [
        "unix:/run/a/vllm.sock",
        "http://127.0.0.1:8000",
    ]
    assert parse_model_map("small-*=unix:/run/a/vllm.sock|unix:/run/b/vllm.sock") == [
        ("small-*", ["unix:/run/a/vllm.sock", "unix:/run/b/vllm.sock"])
    ]
    with pytest.raises(ValueError, match="absolute path"):
        parse_model_map("small-*=unix:relative.sock")
    settings = parse_settings({"agenttap_policy_url": "unix:/run/a/vllm.sock"})
    assert settings.policy_urls == ["unix:/run/a/vllm.sock"]
    with pytest.raises(ValueError, match="agenttap_policy_url"):
        parse_settings({"agenttap_policy_url": "unix:run/vllm.sock"})


# -- reaching a server on a unix socket ---------------------------------------------------------
@pytest.fixture(scope="module")
def private_dir() -> Iterator[Path]:
    # Short: a socket path holds 107 bytes, and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="agenttap-t-") as folder:
        yield Path(folder)


@pytest.fixture(scope="module")
def unix_stub(private_dir: Path) -> Iterator[StubPolicy]:
    stub = StubPolicy(str(QWEN3))
    stub.dev_mode = True
    stub.start(str(private_dir / "vllm.sock"))
    yield stub
    stub.stop()


@pytest.fixture(scope="module")
def dev_tcp_stub() -> Iterator[StubPolicy]:
    stub = StubPolicy(str(QWEN3))
    stub.dev_mode = True
    stub.start()
    yield stub
    stub.stop()


def test_the_stub_serves_on_the_socket_only(unix_stub: StubPolicy, private_dir: Path) -> None:
    assert unix_stub.url == f"unix:{private_dir / 'vllm.sock'}"
    with urlopen(unix_stub.url, "/health", timeout=10) as resp:
        assert resp.status == 200


def test_the_standard_library_reader_ignores_proxies_for_a_socket(
    unix_stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An HTTP_PROXY in the environment must not send a socket's requests to a proxy."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with urlopen(unix_stub.url, "/v1/models", timeout=10) as resp:
        assert resp.status == 200


async def test_a_client_needs_a_session_on_the_socket_it_names(unix_stub: StubPolicy) -> None:
    async with aiohttp.ClientSession() as tcp:
        with pytest.raises(ValueError, match="does not connect to it"):
            VLLMClient(unix_stub.url, tcp)
    async with aiohttp.ClientSession(connector=connector(unix_stub.url)) as http:
        client = VLLMClient(unix_stub.url, http, api="completions")
        unix_stub.script("over the socket")
        out = await client.complete([1, 2, 3], SamplingParams(max_tokens=16))
        assert out.text == "over the socket" and out.token_ids
        assert client.base_url == unix_stub.url  # the name in rows' backend and logs
        # A session to another socket does not reach this server either.
        other = aiohttp.ClientSession(connector=connector("unix:/tmp/elsewhere.sock"))
        async with other:
            with pytest.raises(ValueError):
                VLLMClient(unix_stub.url, other)


async def test_pools_reach_unix_and_tcp_servers_side_by_side(
    unix_stub: StubPolicy, dev_tcp_stub: StubPolicy
) -> None:
    urls = [unix_stub.url, dev_tcp_stub.url]
    pools = PolicyPools(urls, [], [], timeout_s=30, max_connections=8)
    pools.open(lambda ids: "")
    try:
        assert await pools.check_health() == {u: True for u in urls}
        unix_stub.healthy = False
        assert (await pools.check_health())[unix_stub.url] is False
        unix_stub.healthy = True
        assert pools.default is not None
        # The weight label goes to each server through its own client (the stub has no
        # /update_weight_version: best effort, the label is agenttap's).
        outcomes = await pools.weights.set_version(pools.http, pools.default, "step-1")
        assert {o["url"] for o in outcomes} == set(urls)
        assert all(r.client.weight_version == "step-1" for r in pools.default.replicas.values())
        # A replica added while running (POST /replicas) gets its own pool to its socket.
        added = pools.default.add(unix_stub.url + "-gone")
        assert not await pools.default.check(added)
        assert "1-token generation failed" in added.last_error
    finally:
        await pools.close()
    assert all(c.session.closed for c in pools._clients.values())


def test_the_start_up_check_reads_a_server_on_a_socket(unix_stub: StubPolicy) -> None:
    assert check_policy(unix_stub.url, ChatTemplate(str(QWEN3))) is None
    problem = check_policy("unix:/tmp/agenttap-nothing-here.sock", ChatTemplate(str(QWEN3)))
    assert problem and "does not answer" in problem


# -- the dev-mode probe --------------------------------------------------------------------------
def test_a_tcp_server_whose_pause_answers_anyone_is_named_in_a_warning(
    dev_tcp_stub: StubPolicy, caplog: pytest.LogCaptureFixture
) -> None:
    assert open_dev_routes(dev_tcp_stub.url) == [
        "POST /pause (GET /pause: 405)",
        "GET /is_paused (200)",
    ]
    with caplog.at_level(logging.WARNING):
        warning = warn_if_exposed(dev_tcp_stub.url)
    assert warning is not None and dev_tcp_stub.url in warning
    assert "--uds" in warning and "reload_weights" in warning
    assert warning in caplog.text
    # The probe changed nothing: the server is not paused.
    assert dev_tcp_stub.paused is False


def test_no_warning_without_dev_routes_or_on_a_socket(
    stub: StubPolicy, unix_stub: StubPolicy
) -> None:
    assert open_dev_routes(stub.url) == []  # not in dev mode: /pause is a 404
    assert warn_if_exposed(stub.url) is None
    # The socket's server has the routes, but only its folder's owner reaches them.
    assert open_dev_routes(unix_stub.url)
    assert warn_if_exposed(unix_stub.url) is None


def test_no_warning_where_the_routes_want_credentials() -> None:
    """Behind something that asks who calls (401 for every route), nothing is said."""
    from aiohttp import web

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "Unauthorized"}, status=401)

    async def probe() -> list[str]:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", refuse)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await asyncio.to_thread(open_dev_routes, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    assert asyncio.run(probe()) == []


# -- the embedded policy's folder ----------------------------------------------------------------
def test_the_socket_folder_must_be_private() -> None:
    # A short folder: a worker's tmp_path (.../popen-gw0/...) leaves no room for the socket.
    folder = Path(tempfile.mkdtemp(prefix="at-", dir="/tmp")) / "p"
    folder.mkdir(mode=0o700)
    assert launcher.private_folder(folder) is None
    os.chmod(folder, 0o750)
    problem = launcher.private_folder(folder)
    assert problem and "chmod 700" in problem
    with pytest.raises(launcher.PolicyServerError, match="open to other users"):
        launcher.check_socket_path(folder / "vllm.sock")
    os.chmod(folder, 0o700)
    (folder / "vllm.sock").touch()
    with pytest.raises(launcher.PolicyServerError, match="already"):
        launcher.check_socket_path(folder / "vllm.sock")
    deep = folder / ("d" * 80)
    with pytest.raises(launcher.PolicyServerError, match="107 bytes"):
        launcher.check_socket_path(deep / "vllm.sock")


def test_a_private_compile_cache_is_kept_and_any_other_replaced(tmp_path: Path) -> None:
    folder = tmp_path / "policy"
    folder.mkdir(mode=0o700)
    own = tmp_path / "cache"
    own.mkdir(mode=0o700)
    # Kept: a restart (or the tests' next policy) reuses the kernels the last one compiled.
    assert launcher.compile_cache(str(own), folder) == str(own)
    # Code vLLM runs: a cache others could write into, a missing one or none is never used.
    os.chmod(own, 0o775)
    assert launcher.compile_cache(str(own), folder) == str(folder / "cache")
    assert launcher.compile_cache(str(tmp_path / "missing"), folder) == str(folder / "cache")
    assert launcher.compile_cache(None, folder) == str(folder / "cache")
