"""A seeded rollout's calls reach the policy with seeds (issue 40 item 5): ``POST /rollouts
{"seed"}`` through a real mitmdump to the stub, each agent a ``curl`` of the OpenAI chat API
through the proxy. Each call's seed is its session's (``agent_seed``, one per agent) mixed with
its prompt (``call_seed``): the same in a second rollout with the seed, different per agent and
per seed, absent without one; a seed the call names itself is kept."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from capture.control.sessions import agent_seed, call_seed
from tests.support.stub_vllm import StubPolicy

# An agent that makes one chat call (the prompt: its JSON body) through the proxy, with the env
# the rollout gives it (proxy, CA, key).
CURL = {
    "command": [
        "sh", "-c",
        "curl -sS --fail-with-body https://api.openai.com/v1/chat/completions "
        '-H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" -d "$1"',
        "agent",  # $0; the prompt, appended, is $1
    ]
}  # fmt: skip


def sent(stub: StubPolicy, rollout: dict[str, Any], marker: str) -> list[tuple[Any, list[int]]]:
    """(seed, prompt ids) of each call the policy got for ``rollout``'s agents (found by
    ``marker`` in the prompt), sorted; the agents all ended ok."""
    assert all(run["status"] == "ok" for run in rollout["rollouts"]), rollout["rollouts"]
    bodies = [b for b in stub.requests if marker in stub.tok.decode(b["prompt"])]
    assert len(bodies) == len(rollout["rollouts"])
    stub.requests.clear()
    return sorted(((b.get("seed"), b["prompt"]) for b in bodies), key=repr)


def chat(marker: str, **extra: Any) -> str:
    return json.dumps(
        {"model": "gpt-4o", "max_tokens": 4, "messages": [{"role": "user", "content": marker}]}
        | extra
    )


def test_a_seeded_rollouts_calls_carry_its_seeds(stub_tap: AgentTap, stub: StubPolicy) -> None:
    marker = "seeded-rollout-call"
    stub.requests.clear()
    first = sent(stub, stub_tap.rollout(CURL, chat(marker), n=2, seed=11, id="seeded-a"), marker)
    (_, prompt), (_, same) = first
    assert prompt == same  # both agents asked the same; each got its own seed
    assert {seed for seed, _ in first} == {call_seed(agent_seed(11, i), prompt) for i in (0, 1)}
    # The same seed again: the same seeds; another seed: others.
    again = stub_tap.rollout(CURL, chat(marker), n=2, seed=11, id="seeded-b")
    assert sent(stub, again, marker) == first
    other = stub_tap.rollout(CURL, chat(marker), n=2, seed=12, id="seeded-c")
    assert not {seed for seed, _ in sent(stub, other, marker)} & {seed for seed, _ in first}
    # No seed: none sent (the policy's own randomness); a call's own seed is kept.
    plain = stub_tap.rollout(CURL, chat(marker), n=1, id="unseeded")
    assert sent(stub, plain, marker) == [(None, prompt)]
    own = stub_tap.rollout(CURL, chat(marker, seed=99), n=1, seed=11, id="own-seed")
    assert [seed for seed, _ in sent(stub, own, marker)] == [99]


def completion(url: str, prompt: list[int], seed: int) -> list[int]:
    """The token ids the policy samples for ``prompt`` with ``seed`` (temperature 1)."""
    body = {
        "prompt": prompt, "max_tokens": 8, "temperature": 1.0,
        "seed": seed, "return_tokens_as_token_ids": True, "logprobs": 0,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        choice = json.load(answer)["choices"][0]
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


# An agent whose prompt names its folders, as the scaffolds' system prompts do (Claude Code's
# "Working directory", Codex's <cwd>, Gemini CLI's folder structure).
NAMES_ITS_FOLDERS = {
    "command": [
        "sh", "-c",
        "curl -sS --fail-with-body https://api.openai.com/v1/chat/completions "
        '-H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" '
        '-d "{\\"model\\":\\"gpt-4o\\",\\"max_tokens\\":4,\\"messages\\":[{\\"role\\":'
        '\\"user\\",\\"content\\":\\"$1 in $(pwd) home $HOME tmp $TMPDIR\\"}]}"',
        "agent",
    ]
}  # fmt: skip


def test_the_same_seed_in_another_folder_sends_the_same_prompts(
    stub_tap: AgentTap, stub: StubPolicy
) -> None:
    """Issue 51 item 1: each group's runs live under OUT/rollouts/ID/I on the host, yet an
    agent sees its folders at the same places (agenttap_sandbox_paths fixed), so two groups
    with one seed send the same prompts and seeds, and a group's agents the same prompt."""
    marker = "folder-free-prompt"
    stub.requests.clear()
    first = stub_tap.rollout(NAMES_ITS_FOLDERS, marker, n=2, seed=5, id="folders-a")
    calls = sent(stub, first, marker)
    second = sent(
        stub, stub_tap.rollout(NAMES_ITS_FOLDERS, marker, n=2, seed=5, id="folders-b"), marker
    )
    assert second == calls
    (_, prompt), (_, same) = calls
    assert prompt == same
    text = stub.tok.decode(prompt)
    assert f"{marker} in /workdir home /home/agent tmp /tmp/agent" in text, text
    assert "folders-a" not in text and str(stub_tap.out) not in text


@pytest.mark.vllm
def test_a_seeded_long_prompt_on_the_real_vllm(vllm_url: str) -> None:
    """A prompt longer than one step's token budget is prefilled in chunks; vLLM samples (and
    throws away) a token at each partial chunk and rewinds the request's generator by an offset
    a CPU generator does not have: the engine died (RuntimeError "CPU Generator does not use
    offset"). policy_server/worker.py rewinds it by its state: the call is answered, and the
    same seed samples the same tokens however the prompt was chunked."""
    long_prompt = [100 + (i * 7919) % 5000 for i in range(12_000)]
    other_prompt = [100 + (i * 104_729) % 5000 for i in range(12_000)]
    first = completion(vllm_url, long_prompt, seed=7)
    assert len(first) == 8
    # Again, beside another long prompt (other chunks; a cached prefix): the same tokens.
    with ThreadPoolExecutor(2) as pool:
        again = pool.submit(completion, vllm_url, long_prompt, 7)
        beside = pool.submit(completion, vllm_url, other_prompt, 7)
        assert again.result() == first and len(beside.result()) == 8
    # Each seed its own draws: over three seeds, not all alike.
    others = [completion(vllm_url, long_prompt, seed=s) for s in (8, 9)]
    assert any(o != first for o in others)
