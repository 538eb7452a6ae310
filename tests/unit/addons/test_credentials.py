"""addons/credentials.py: every key leaves a request before anything logs or saves it."""

from __future__ import annotations

from mitmproxy.test import tutils

from addons.credentials import proxy_user, strip_secrets


def test_keys_in_headers_and_query_go_the_rest_stays() -> None:
    req = tutils.treq(path=b"/v1beta/models/m:generateContent?alt=sse&Key=AIza-secret&api-key=x")
    req.headers["Authorization"] = "Bearer sk-secret"
    req.headers["X-API-Key"] = "sk-ant-secret"
    req.headers["x-goog-api-key"] = "AIza-secret"
    req.headers["Proxy-Authorization"] = "Basic c2Vzc2lvbjp4"
    req.headers.add("authorization", "Bearer second-copy")
    req.headers["X-Request-Id"] = "keep-me"
    strip_secrets(req)
    assert "secret" not in bytes(req.headers).decode() + req.path
    assert "Authorization" not in req.headers and "Proxy-Authorization" not in req.headers
    assert req.headers["X-Request-Id"] == "keep-me"
    assert req.headers["header"] == "qvalue"  # treq's own, untouched
    assert req.path == "/v1beta/models/m:generateContent?alt=sse"


def test_a_request_without_keys_is_left_as_it_is() -> None:
    req = tutils.treq(path=b"/v1/chat/completions")
    before = req.headers.fields
    strip_secrets(req)
    assert req.headers.fields == before and req.path == "/v1/chat/completions"


def test_the_proxy_username_is_the_session() -> None:
    assert proxy_user("Basic c2Vzc2lvbjp4") == "session"
    assert proxy_user("Bearer c2Vzc2lvbjp4") is None
    assert proxy_user("Basic !!!") is None
    assert proxy_user(None) is None
