"""Conservation end to end: the real openai SDK -> mitmdump -> the scripted stub, asserting on the
shards. One session holds several conversations whose policy replies are identical; one of them
is then rewritten (a reminder injected into its first user message); the SDK resends identical
requests (with its retry header, and without one, as a user pressing retry does)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from tests.support.proxies import Proxy
from tests.support.stub_vllm import StubPolicy

SYSTEM = {"role": "system", "content": "You are a careful agent."}


def ask(client: Any, messages: list[dict[str, Any]], retry: bool = False) -> Any:
    # The SDK's own retry sends the identical body with x-stainless-retry-count: N.
    headers = {"x-stainless-retry-count": "1"} if retry else None
    return client.chat.completions.create(model="gpt-4o", messages=messages, extra_headers=headers)


def conservation(threads: list[dict[str, Any]], turns: list[dict[str, Any]]) -> dict[str, str]:
    """Every call trained in exactly one row at its own sampled ids; no token twice. Returns
    request id -> the thread id of the row that trains it."""
    trained: Counter[str] = Counter()
    where: dict[str, str] = {}
    by_request = {t["request_id"]: t for t in turns}
    for row in threads:
        for span in row["turns"]:
            call = by_request[span["request_id"]]
            assert span["status"] != "dropped", span
            assert row["input_ids"][span["start"] : span["end"]] == call["completion_ids"]
            if span["status"] == "trained":
                trained[span["request_id"]] += 1
                where[span["request_id"]] = row["thread_id"]
                assert all(row["loss_mask"][span["start"] : span["end"]])
        assert set(row["trained_request_ids"]) == {
            s["request_id"] for s in row["turns"] if s["status"] == "trained"
        }
    assert dict(trained) == {rid: 1 for rid in by_request}, "each call trained exactly once"
    total = sum(sum(row["loss_mask"]) for row in threads)
    assert total == sum(len(t["completion_ids"]) for t in turns), "no token trained twice"
    for t in turns:
        assert t["thread_id"] == where[t["request_id"]]
    return where


def test_identical_replies_across_conversations_then_a_rewrite(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = "cons-identical"
    stub.replies.clear()
    stub.script("Done.", "Done.", "Done.", "Done.", "All set.")
    client = stub_proxy.openai(session, monkeypatch)
    a = [SYSTEM, {"role": "user", "content": "Rename the config file."}]
    b = [SYSTEM, {"role": "user", "content": "Delete the temp folder."}]
    ra1 = ask(client, a)
    rb1 = ask(client, b)
    b += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Also the cache."}]
    rb2 = ask(client, b)
    a += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "And the backup."}]
    ra2 = ask(client, a)
    # The scaffold injects a reminder into B's first user message and goes on.
    b[1] = {
        "role": "user",
        "content": "<system-reminder>cwd: /repo</system-reminder>\nDelete the temp folder.",
    }
    b += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    rb3 = ask(client, b)
    assert rb3.choices[0].message.content == "All set."

    turns = stub_proxy.turns(session, expect=5)
    threads = stub_proxy.threads(session, expect=2)
    where = conservation(threads, turns)
    assert where[ra1.id] == where[ra2.id], "A's turns stay together"
    assert where[rb1.id] == where[rb2.id] == where[rb3.id], "the rewrite stays on B"
    assert where[ra1.id] != where[rb1.id]
    kinds = {t["request_id"]: t["metadata"] for t in turns}
    assert '"rewrite"' in kinds[rb3.id]
    assert not any(row["dead"] for row in threads)


@pytest.mark.parametrize("marked", [True, False], ids=["sdk-retry-header", "user-retry"])
def test_a_retry_is_a_dead_sibling_and_the_live_row_keeps_the_history(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch, marked: bool
) -> None:
    session = f"cons-retry-{'marked' if marked else 'user'}"
    stub.replies.clear()
    stub.script("Looking at the logs.", "The disk is full.", "The network is down.", "Rebooting.")
    client = stub_proxy.openai(session, monkeypatch)
    msgs = [SYSTEM, {"role": "user", "content": "Why did the job fail?"}]
    first = ask(client, msgs)
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Go on."},
    ]
    lost = ask(client, msgs)
    kept = ask(client, msgs, retry=marked)  # identical request, resent
    assert lost.choices[0].message.content != kept.choices[0].message.content
    msgs += [
        {"role": "assistant", "content": kept.choices[0].message.content},
        {"role": "user", "content": "Fix it."},
    ]
    after = ask(client, msgs)

    turns = stub_proxy.turns(session, expect=4)
    threads = stub_proxy.threads(session, expect=2)
    where = conservation(threads, turns)
    by_id = {row["thread_id"]: row for row in threads}
    live, dead = by_id[where[after.id]], by_id[where[lost.id]]
    assert live["trained_request_ids"] == [first.id, kept.id, after.id] and not live["dead"]
    assert dead["trained_request_ids"] == [lost.id]
    assert dead["dead"] and dead["dead_reason"] == "superseded"
    assert dead["superseded_by"] == live["thread_id"]
    assert dead["parent_thread_id"] == live["thread_id"] and dead["parent_relation"] == "branch"
    # The dead row carries the shared history as context only, masked.
    assert [s["status"] for s in dead["turns"]] == ["context", "trained"]
    assert dead["turns"][0]["trained_in"] == live["thread_id"]
    # Both answers were sampled from the very same prompt.
    prompts = {t["request_id"]: t["prompt_ids"] for t in turns}
    assert prompts[lost.id] == prompts[kept.id]


def test_a_schema_constrained_answer_trains_the_policys_own_logprobs(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a JSON schema vLLM reports the constrained distribution's logprobs; the turns shard
    keeps them as returned, the thread row trains a re-score (provenance 2) instead."""
    session = "cons-schema"
    stub.replies.clear()
    stub.script('{"city": "Paris"}')
    client = stub_proxy.openai(session, monkeypatch)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    resp = client.chat.completions.create(
        model="gpt-4o",
        messages=[SYSTEM, {"role": "user", "content": "Where?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    )
    assert resp.choices[0].message.content == '{"city": "Paris"}'
    (turn,) = stub_proxy.turns(session, expect=1)
    (row,) = stub_proxy.threads(session, expect=1)
    assert '"constrained": "json_schema"' in turn["metadata"]
    start = len(turn["prompt_ids"])
    span = range(start, start + len(turn["completion_ids"]))
    assert [row["provenance"][i] for i in span] == [2] * len(span)
    assert all(row["loss_mask"][i] for i in span)
    # The trained logprobs are the stub's prompt_logprobs of those positions, not the sampler's.
    expected = [StubPolicy._logprob_of(i, row["input_ids"][i]) for i in span]
    assert [row["logprobs"][i] for i in span] == pytest.approx(expected, abs=1e-6)
    assert turn["completion_logprobs"] != pytest.approx(expected, abs=1e-6)


def test_responses_item_ids_decide_between_identical_text_replies(
    stub_proxy: Proxy, stub: StubPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Responses API, stateless (store=false): two conversations both answered "Done.";
    the older one goes on with its first user message replaced outright, so no text is left
    to tell it from its twin. The output items the client sends back carry the proxy's item
    ids, which name the response: the rewrite stays on the older conversation's thread."""
    session = "cons-responses-ids"
    stub.replies.clear()
    stub.script("Done.", "Done.", "All set.")
    client = stub_proxy.openai(session, monkeypatch)

    def respond(items: list[Any]) -> Any:
        return client.responses.create(model="gpt-5", instructions="You are a careful agent.", input=items, store=False)  # fmt: skip

    a: list[Any] = [{"role": "user", "content": "Rename the config file."}]
    ra1 = respond(a)
    rb1 = respond([{"role": "user", "content": "Delete the temp folder."}])
    assert ra1.output_text == rb1.output_text == "Done."
    a = [{"role": "user", "content": "(earlier context compacted)"}]
    a += [item.model_dump(exclude_none=True) for item in ra1.output]
    a.append({"role": "user", "content": "And the backup."})
    ra2 = respond(a)
    assert ra2.output_text == "All set."

    turns = stub_proxy.turns(session, expect=3)
    threads = stub_proxy.threads(session, expect=2)
    where = conservation(threads, turns)
    # Turn rows are keyed by the proxy's request ids; the Responses ids name the same calls.
    by_order = [t["request_id"] for t in sorted(turns, key=lambda t: t["turn_index"])]
    first_a, first_b, second_a = by_order
    assert where[second_a] == where[first_a] != where[first_b]
    kinds = {t["request_id"]: json.loads(t["metadata"])["assembly"] for t in turns}
    assert kinds[second_a] == "rewrite"
