"""A server that is no keyless vLLM refuses agenttap's first request: the error says what it most
likely means and what to change (issue 51: "Unauthorized" alone named nothing)."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rewriter.vllm_answers import PolicyError
from rewriter.vllm_client import VLLMClient
from rewriter.vllm_request import PolicyInfo


@pytest.mark.parametrize(
    ("status", "said"),
    [
        (401, "the server wants a key, and agenttap sends none"),
        (403, "serve vLLM without --api-key"),
        (404, "is it a vLLM server? agenttap_policy_url names the server itself"),
    ],
)
async def test_a_refusing_server_is_named_with_the_likely_fix(status: int, said: str) -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "Unauthorized"}}, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            client = VLLMClient(str(server.make_url("")).rstrip("/"), http)
            with pytest.raises(PolicyError) as err:
                await client.served()
            assert f"/v1/models answered {status}; " in str(err.value) and said in str(err.value)
            # A request past the listing (the listing known): the same words.
            client._info = PolicyInfo(model="m", max_model_len=64)
            with pytest.raises(PolicyError) as err:
                await client.prompt_logprobs([1, 2, 3])
            if status == 404:  # there: vLLM's own "no such model", its message as it is
                assert str(err.value).endswith("policy server answered 404: Unauthorized")
            else:
                assert f"policy server answered {status}: Unauthorized; " in str(err.value)
                assert said in str(err.value)
    finally:
        await server.close()
