"""The control API's routes and its OpenAPI document (capture/control/routing.py,
capture/control/openapi.py): the document names every route served and no other, the bodies'
schemas are the models', and the routes answer as they always have (the token before the
route, 404 and 405 with the route list, the open ones)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from capture.control.api import ControlAPI
from capture.control.endpoints import Endpoints
from capture.control.models import SessionBody, read_session
from capture.control.openapi import OPEN_PATHS, REF, openapi_spec
from capture.gateway import Gateway, GatewayConfig
from capture.rollouts.agents import AGENTS
from capture.rollouts.spec import RolloutBody

TOKEN = "t" * 32
API_URL = "http://127.0.0.1:1"


@pytest.fixture
def api(tmp_path: Path, qwen3_dir: Path) -> ControlAPI:
    gateway = Gateway(GatewayConfig(["http://127.0.0.1:9"], qwen3_dir, tmp_path))
    return ControlAPI(gateway, TOKEN, Endpoints(API_URL, "", "/ca.pem"))


def call(
    api: ControlAPI, method: str, path: str, token: str | None = TOKEN, bearer: str | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = make_mocked_request(method, path, headers=headers, app=None)
    answer: Any = asyncio.run(api.handle(request, bearer))
    return answer.status, json.loads(answer.body) if answer.body else None


def test_the_document_names_every_route_served_and_no_other(api: ControlAPI) -> None:
    spec = openapi_spec(API_URL)
    assert spec["openapi"] == "3.1.0" and set(spec) >= {"openapi", "info", "paths"}
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    served = {(r.method, r.path) for r in api.routes.routes} | {("GET", "/ui/")}
    assert documented == served
    for route in api.routes.routes:
        operation = spec["paths"][route.path][route.method.lower()]
        # The token is wanted where the document says so.
        assert ("security" in operation) == (route.access == "token"), route
        assert (route.access != "token") == (route.path in OPEN_PATHS)
        params = [p["name"] for p in operation.get("parameters", [])]
        assert params == (["id"] if "{id}" in route.path else []), route


def test_the_bodies_schemas_are_the_models(api: ControlAPI) -> None:
    spec = openapi_spec(API_URL)
    schemas = spec["components"]["schemas"]
    for name, model, path in [
        ("SessionBody", SessionBody, "/sessions"),
        ("RolloutBody", RolloutBody, "/rollouts"),
    ]:
        schema = model.model_json_schema(ref_template=REF)
        for nested, sub in schema.pop("$defs", {}).items():
            assert schemas[nested] == sub
        assert schemas[name] == schema
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": REF.format(model=name)}
    # Every $ref resolves.
    refs = set(_refs(spec))
    assert refs and {r.rsplit("/", 1)[1] for r in refs} <= set(schemas)
    agent = schemas["RolloutBody"]["properties"]["agent"]["oneOf"][0]
    assert agent == {"type": "string", "enum": list(AGENTS)}
    # What is served is this document.
    assert call(api, "GET", "/openapi.json") == (200, json.loads(json.dumps(spec)))


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_the_token_is_asked_before_the_route_is_looked_up(api: ControlAPI) -> None:
    for path in ["/sessions", "/nowhere", "/sessions/x/close", "/openapi.json"]:
        status, body = call(api, "GET", path, token=None)
        assert status == 401 and "Authorization: Bearer TOKEN" in body["error"]["message"]
        # The way the docs give to set one's own token (a file, never the command line).
        assert "--set agenttap_token_file=FILE" in body["error"]["message"]
        assert call(api, "GET", path, token="wrong")[0] == 403
    # Through the proxy the addon has checked the header already.
    assert call(api, "GET", "/sessions", token=None, bearer="")[0] == 401
    assert call(api, "GET", "/sessions", token=None, bearer="wrong")[0] == 403
    assert call(api, "GET", "/sessions", token=None, bearer="ok")[0] == 200


def test_unknown_routes_and_methods_name_the_routes(api: ControlAPI) -> None:
    status, body = call(api, "GET", "/nowhere")
    assert status == 404 and "no route GET /nowhere" in body["error"]["message"]
    assert "POST /sessions/ID/close" in body["error"]["message"]
    status, body = call(api, "DELETE", "/sessions/x")
    assert status == 405 and "no route DELETE /sessions/x" in body["error"]["message"]
    assert call(api, "PUT", "/policy/version")[0] == 405
    # A GET route does not answer HEAD.
    assert call(api, "HEAD", "/sessions")[0] == 405
    # The open routes: any caller, and a wrong method is a 405 without the token.
    assert call(api, "GET", "/healthz", token=None) == (200, {"ok": True})
    assert call(api, "POST", "/healthz", token=None)[0] == 405
    assert call(api, "POST", "/ready", token=None)[0] == 405
    # A trailing slash is the same route; a path's part is passed to its handler.
    assert call(api, "GET", "/sessions/")[0] == 200
    status, body = call(api, "GET", "/sessions/nope/")
    assert status == 404 and "no session 'nope'" in body["error"]["message"]
    status, body = call(api, "GET", "/rollouts/r-1")
    assert status == 404 and "no rollout 'r-1'" in body["error"]["message"]


def test_a_session_body_is_told_what_is_wrong_in_its_own_words() -> None:
    assert (
        read_session({"id": "a-1", "limits": {"deadline_s": 2}}).session_limits().deadline_s == 2.0
    )
    for body, words in [
        ([1], "the body must be a JSON object"),
        ({"x": 1, "id": "a b"}, "unknown field(s) x; known: id, metadata, limits"),
        ({"id": "a b"}, "\"id\" must be 1 to 128 letters"),
        ({"limits": [1]}, '"limits" must be an object: {"max_calls", "max_tokens", "deadline_s"}'),
        ({"limits": {"max_turns": 1}}, "unknown limit(s) max_turns; known: max_calls"),
        ({"limits": {"max_calls": True}}, '"limits.max_calls" must be a whole number of at '
         "least 1, not True"),
        ({"limits": {"deadline_s": float("inf")}}, '"limits.deadline_s" must be a number of '
         "seconds > 0, not inf"),
        ({"metadata": {"split": "test"}}, '"metadata.split" must be one of train, val'),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as exc:
            read_session(body)
        assert words in str(exc.value), (body, str(exc.value))


def test_a_path_argument_is_one_segment_of_the_decoded_path(api: ControlAPI) -> None:
    """An encoded "/" does not make an id of several segments ("a/../b"): no such route, as
    when the path was split by hand; a plain id still reaches its handler."""
    for path in ("/sessions/a%2F..%2Fb/reward", "/sessions/..%2Fx", "/rollouts/r%2F1"):
        method = "POST" if path.endswith("reward") else "GET"
        status, body = call(api, method, path)
        assert status == 404 and "no route" in body["error"]["message"], (path, body)
    status, body = call(api, "GET", "/sessions/a..b")
    assert status == 404 and "no session 'a..b'" in body["error"]["message"]
