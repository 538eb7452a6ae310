"""The OpenAI Responses API through the real proxy: the real openai SDK -> mitmdump -> the stub.

Whole and streamed responses, a function-call loop whose second call extends the first thread
exactly, previous_response_id, structured output, input_tokens and errors in OpenAI's format.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.providers.test_openai_tools_stub import (
    WEATHER_ARGS,
    check_row,
    expected_ids,
    hermes,
    script,
)
from tests.support.proxies import Proxy
from tests.support.stub_vllm import StubPolicy

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    }
]


def assembly_of(rows: list[dict[str, Any]]) -> list[str]:
    return [json.loads(r["metadata"])["assembly"] for r in rows]


def test_whole_response(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "<think>\nShort.\n</think>\n\nHello from the policy."
    n = script(stub, text)
    client = stub_proxy.openai("resp-whole", monkeypatch)
    resp = client.responses.create(
        model="gpt-5", instructions="Be brief.", input="Say hello.", max_output_tokens=200
    )
    assert resp.status == "completed"
    assert resp.id.startswith("resp_")
    assert resp.output_text == "Hello from the policy."
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Short."  # type: ignore[union-attr,index]
    ids = expected_ids(tok, text)
    assert resp.usage is not None and resp.usage.output_tokens == len(ids)
    assert resp.usage.input_tokens == len(stub.requests[n]["prompt"])
    assert stub.requests[n]["max_tokens"] == 200
    prompt = tok.decode(stub.requests[n]["prompt"])
    assert prompt.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello."
    )

    rows = stub_proxy.turns("resp-whole", expect=1)
    assert len(rows) == 1
    check_row(rows[0], stub, n, ids)
    assert rows[0]["protocol"] == "openai.responses"
    assert rows[0]["response_finish_reason"] == "completed"


def test_streamed_response_event_sequence(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "<think>\nPlan it.\n</think>\n\nLet me look." + hermes("get_weather", WEATHER_ARGS)
    n = script(stub, text)
    client = stub_proxy.openai("resp-stream", monkeypatch)
    events = list(
        client.responses.create(
            model="gpt-5",
            input="Weather in Paris?",
            tools=TOOLS,
            stream=True,  # type: ignore[arg-type]
        )
    )
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    # Items open and close in output order: reasoning, then text, then the call.
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index(
        "response.function_call_arguments.delta"
    )
    for needed in (
        "response.output_item.added",
        "response.content_part.added",
        "response.content_part.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert needed in kinds
    assert (
        kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == "Let me look."
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == WEATHER_ARGS
    assert call.call_id.startswith("call_")
    ids = expected_ids(tok, text)
    assert final.usage.output_tokens == len(ids)
    assert stub.requests[n]["stream"] is True

    rows = stub_proxy.turns("resp-stream", expect=1)
    check_row(rows[0], stub, n, ids)
    assert rows[0]["stream"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_function_call_loop_extends_the_thread(
    stream: bool,
    stub_proxy: Proxy,
    stub: StubPolicy,
    tok: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK's documented loop: send back the output items plus a function_call_output; the
    second call's prompt is the first call's prompt + its sampled ids + the tool result."""
    session = f"resp-loop-{stream}"
    first_text = "<think>\nNeed the tool.\n</think>\n\n" + hermes("get_weather", WEATHER_ARGS)
    n = script(stub, first_text, "It is 21 degrees in Paris.")
    client = stub_proxy.openai(session, monkeypatch)
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]

    def call() -> Any:
        if not stream:
            return client.responses.create(
                model="gpt-5",
                input=history,
                tools=TOOLS,  # type: ignore[arg-type]
                store=False,
                include=["reasoning.encrypted_content"],
            )
        with client.responses.stream(
            model="gpt-5",
            input=history,
            tools=TOOLS,  # type: ignore[arg-type]
            store=False,
            include=["reasoning.encrypted_content"],
        ) as events:
            return events.get_final_response()

    first = call()
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1
    reasoning = [i for i in first.output if i.type == "reasoning"]
    assert reasoning and reasoning[0].encrypted_content
    # Stateless client: it sends back only what it got, reasoning as the encrypted token.
    for item in first.output:
        echoed = item.model_dump(exclude_none=True)
        if echoed["type"] == "reasoning":
            echoed.pop("content", None)
        echoed["internal_chat_message_metadata_passthrough"] = {"turn": 1}
        history.append(echoed)
    history.append(
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C, sunny"}
    )
    second = call()
    assert second.output_text == "It is 21 degrees in Paris."

    rows = stub_proxy.turns(session, expect=2)
    assert len(rows) == 2
    assert assembly_of(rows) == ["new", "extend"]
    first_ids = expected_ids(tok, first_text)
    second_prompt = stub.requests[n + 1]["prompt"]
    assert second_prompt[: len(stub.requests[n]["prompt"]) + len(first_ids)] == (
        stub.requests[n]["prompt"] + first_ids
    )
    assert "21 C, sunny" in tok.decode(second_prompt[len(stub.requests[n]["prompt"]) :])
    threads = stub_proxy.threads(session, expect=1)
    assert len(threads) == 1


def test_previous_response_id_continues_a_stored_response(
    stub_proxy: Proxy, stub: StubPolicy, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = script(stub, "Paris.", "About two million.")
    client = stub_proxy.openai("resp-stored", monkeypatch)
    first = client.responses.create(model="gpt-5", input="Capital of France?", store=True)
    second = client.responses.create(
        model="gpt-5", input="Its population?", previous_response_id=first.id
    )
    assert second.output_text == "About two million."
    assert second.previous_response_id == first.id
    rows = stub_proxy.turns("resp-stored", expect=2)
    assert assembly_of(rows) == ["new", "extend"]
    first_ids = expected_ids(tok, "Paris.")
    assert stub.requests[n + 1]["prompt"][: len(stub.requests[n]["prompt"]) + len(first_ids)] == (
        stub.requests[n]["prompt"] + first_ids
    )

    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="gpt-5", input="x", previous_response_id="resp_unknown")
    assert err.value.status_code == 400
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert err.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    # Another session cannot continue this session's response.
    other = stub_proxy.openai("resp-stored-other", monkeypatch)
    with pytest.raises(openai.BadRequestError):
        other.responses.create(model="gpt-5", input="x", previous_response_id=first.id)


def test_structured_output_is_constrained(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    n = script(stub, '{"city": "Paris"}')
    client = stub_proxy.openai("resp-schema", monkeypatch)
    resp = client.responses.create(
        model="gpt-5",
        input="Which city?",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    assert json.loads(resp.output_text) == {"city": "Paris"}
    assert stub.requests[n]["structured_outputs"] == {"json": schema}


def test_input_tokens_counts_the_prompt(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = script(stub, "Counted.")
    client = stub_proxy.openai("resp-count", monkeypatch)
    body = {"model": "gpt-5", "input": "Count me.", "instructions": "Be brief."}
    counted = client.post("/responses/input_tokens", body=body, cast_to=object)
    client.responses.create(**body)  # type: ignore[arg-type]
    assert counted == {
        "object": "response.input_tokens",
        "input_tokens": len(stub.requests[n]["prompt"]),
    }


def test_bad_input_is_an_openai_error(stub_proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    client = stub_proxy.openai("resp-bad", monkeypatch)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model="gpt-5",
            input=[{"type": "mystery_item", "x": 1}],  # type: ignore[list-item]
        )
    error = err.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "input[0].type" and "mystery_item" in error["message"]
    # A side call of the Agents SDK is answered locally, not 404.
    assert client.post("/traces/ingest", body={"data": []}, cast_to=object) == {}


def test_websocket_mode(stub_proxy: Proxy, stub: StubPolicy, tok: Any) -> None:
    """The Responses WebSocket mode through mitmdump, as Codex uses it: a warm-up, a turn, a
    turn continuing it by previous_response_id with only the new items, and a bad message
    answered with an error event on a connection that stays open."""
    import asyncio
    import ssl

    import aiohttp

    n = script(stub, "First answer.", "Second answer.")

    async def converse() -> list[list[dict[str, Any]]]:
        context = ssl.create_default_context(cafile=str(stub_proxy.ca))
        answers: list[list[dict[str, Any]]] = []
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(
                "wss://api.openai.com/v1/responses",
                proxy=f"http://resp-ws:x@127.0.0.1:{stub_proxy.port}",
                ssl=context,
            ) as ws:

                async def exchange(message: dict[str, Any]) -> list[dict[str, Any]]:
                    await ws.send_str(json.dumps({"type": "response.create", **message}))
                    events = []
                    while True:
                        event = json.loads(await ws.receive_str(timeout=30))
                        events.append(event)
                        if event["type"] in ("response.completed", "error", "response.failed"):
                            return events

                base = {"model": "gpt-5", "store": False}
                warm = await exchange({**base, "input": None, "generate": False})
                first = await exchange(
                    {**base, "input": "Hello?", "previous_response_id": warm[-1]["response"]["id"]}
                )
                bad = await exchange({**base, "input": [{"type": "mystery_item"}]})
                second = await exchange(
                    {
                        **base,
                        "input": "And again?",
                        "previous_response_id": first[-1]["response"]["id"],
                    }
                )
                answers = [warm, first, bad, second]
        return answers

    warm, first, bad, second = asyncio.run(converse())
    assert [e["type"] for e in warm] == ["response.created", "response.completed"]
    assert warm[-1]["response"]["output"] == []
    assert first[-1]["response"]["output"][0]["content"][0]["text"] == "First answer."
    assert [e["sequence_number"] for e in first] == list(range(len(first)))
    assert bad == [
        {
            "type": "error",
            "status": 400,
            "error": bad[0]["error"],
        }
    ]
    assert bad[0]["error"]["param"] == "input[0].type"
    assert second[-1]["response"]["output"][0]["content"][0]["text"] == "Second answer."
    # Two policy calls (the warm-up and the bad message made none); the second extends the first.
    assert len(stub.requests) - n == 2
    rows = stub_proxy.turns("resp-ws", expect=2)
    assert [json.loads(r["metadata"])["assembly"] for r in rows] == ["new", "extend"]
    first_ids = expected_ids(tok, "First answer.")
    assert stub.requests[n + 1]["prompt"][: len(stub.requests[n]["prompt"]) + len(first_ids)] == (
        stub.requests[n]["prompt"] + first_ids
    )


def test_codex_session_header_names_the_session_without_a_proxy_username(
    stub_proxy: Proxy, stub: StubPolicy
) -> None:
    """Codex run with no proxy credentials: its own ``session-id`` header keeps its runs apart
    (``codex:<id>``) instead of one shared ``anonymous`` session."""
    import http.client
    import ssl
    import uuid

    run = uuid.uuid4().hex
    script(stub, "Hello from the policy.")
    ctx = ssl.create_default_context(cafile=str(stub_proxy.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", stub_proxy.port, context=ctx, timeout=60)
    conn.set_tunnel("api.openai.com", 443)  # no Proxy-Authorization: no username
    body = json.dumps({"model": "gpt-5", "input": "Say hello.", "store": False})
    conn.request(
        "POST",
        "/v1/responses",
        body=body,
        headers={
            "Content-Type": "application/json",
            "session-id": run,
            "Authorization": "Bearer sk-x",
        },
    )
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    assert json.loads(resp.read())["output"][-1]["content"][0]["text"] == "Hello from the policy."
    conn.close()
    (row,) = stub_proxy.turns(f"codex:{run}", expect=1)
    assert (
        row["session_id"] == f"codex:{run}" and row["completion_text"] == "Hello from the policy."
    )
