"""The Anthropic Messages API against the real vLLM (fp32 tiny Qwen3): exact logprobs over a
multi-turn session with thinking on, streamed and not, and JSON constrained by vLLM's
structured outputs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.e2e.providers.test_trajectory_vllm import _assert_exact, _threads
from tests.support.proxies import Proxy

pytestmark = pytest.mark.vllm


def _reply_blocks(msg: Any) -> list[dict[str, Any]]:
    return [b.model_dump(exclude_none=True) for b in msg.content]


def test_multi_turn_session_is_exact(
    vllm_proxy: Proxy, vllm_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = vllm_proxy.anthropic("anth-vllm", monkeypatch)
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=00001;"},
        {"type": "text", "text": "You are terse."},
    ]
    messages: list[dict[str, Any]] = []
    for i in range(3):
        messages.append({"role": "user", "content": f"Question {i}: what is {i} + {i}?"})
        kwargs: dict[str, Any] = {
            "model": "claude-opus-4-5",
            "max_tokens": 24,
            "system": system,
            "messages": messages,
            "thinking": {"type": "adaptive"},
        }
        if i == 1:
            with client.messages.stream(**kwargs) as stream:
                msg = stream.get_final_message()
        else:
            msg = client.messages.create(**kwargs)
        assert msg.stop_reason in ("end_turn", "max_tokens")
        messages.append({"role": "assistant", "content": _reply_blocks(msg)})
        # The billing header's cch= changes on every call, as Claude Code's does.
        system = [{**system[0], "text": f"x-anthropic-billing-header: cch=0000{i + 2};"}, system[1]]
    turns = vllm_proxy.turns("anth-vllm", expect=3, timeout=60)
    assert [json.loads(t["metadata"])["assembly"] for t in turns] == ["new", "extend", "extend"]
    (row,) = _threads(vllm_proxy, "anth-vllm", 3)
    assert row["num_turns"] == 3 and row["protocol"] == "anthropic.messages"
    assert _assert_exact(row, turns, vllm_url) == 0.0


def test_structured_output_from_the_real_policy(
    vllm_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claude Code's title call: a random policy still has to give schema-valid JSON.

    Greedy, so that the run is the same every time. It needs the policy server's
    disable_any_whitespace (policy_server/launcher.py): without it, greedy gives ``{`` and then
    whitespace up to max_tokens."""
    client = vllm_proxy.anthropic("anth-vllm-json", monkeypatch)
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}},
        "required": ["title"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model="claude-haiku-4-5",
        max_tokens=200,
        messages=[{"role": "user", "content": "Write a title for: create hello.txt"}],
        # In the body: this SDK's create() no longer takes temperature, the API still does.
        extra_body={
            "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    assert msg.stop_reason == "end_turn", msg
    value = json.loads(msg.content[0].text)
    assert set(value) == {"title"} and isinstance(value["title"], str)
