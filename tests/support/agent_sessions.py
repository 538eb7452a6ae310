"""Agent-like sessions for the storage bench and tests: long conversations that grow by the
agent's replies and its tools' outputs, recorded through ``SessionStore`` as the gateway would.

Text comes from this repository's own files (code and prose, as an agent reading a repository
sees); token ids from the real template; logprobs random but shaped like a sampler's."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from capture.storage.records import TurnRecord
from capture.storage.sessions import SessionStore
from rewriter.canonical import ChatRequest, Message
from rewriter.template import ChatTemplate

REPO = Path(__file__).resolve().parents[2]
CHARS_PER_TOKEN = 3.3  # about what Qwen3's tokenizer makes of this repository's code and prose


@dataclass
class Call:
    messages: list[Message]
    text: str
    ids: list[int]
    logprobs: list[float]
    retry: bool = False  # the client resent the request before (a dead branch before it)


@dataclass
class Script:
    session_id: str
    calls: list[Call] = field(default_factory=list)


def corpus() -> str:
    files = sorted(REPO.glob("capture/**/*.py")) + sorted(REPO.glob("rewriter/**/*.py"))
    files += sorted(REPO.glob("docs/*.md")) + sorted(REPO.glob("tests/**/*.py"))
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def sampler_logprobs(rng: random.Random, n: int) -> list[float]:
    """Most tokens near-certain (tiny negative values), the rest spread out."""
    return [
        -math.exp(rng.uniform(-16.0, -3.0)) if rng.random() < 0.6 else -rng.expovariate(0.8)
        for _ in range(n)
    ]


def build(
    template: ChatTemplate, text: str, name: str, calls: int, context: int, seed: int
) -> Script:
    """A session of ``calls`` calls whose conversation grows to about ``context`` tokens: the
    agent's replies (20-30% of the tokens), then tool outputs; one request resent by its client
    (so one dead row)."""
    rng = random.Random(seed)

    def chunk(tokens: float) -> str:
        n = max(20, int(tokens * CHARS_PER_TOKEN))
        start = rng.randrange(len(text) - n)
        return text[start : start + n]

    def reply(per_call: float) -> tuple[str, list[int], list[float]]:
        said = chunk(rng.uniform(0.1, 0.5) * per_call)
        ids = template.encode(said) + [template.eos_token_id]
        return said, ids, sampler_logprobs(rng, len(ids))

    per_call = context / calls
    msgs = [
        Message("system", "You are a coding agent working in a git repository.\n" + chunk(1500)),
        Message("user", "Fix the failing test.\n" + chunk(200)),
    ]
    script = Script(name)
    retry_at = rng.randrange(calls // 4, max(calls // 4 + 1, calls // 2))
    for i in range(calls):
        said, ids, lps = reply(per_call)
        script.calls.append(Call(list(msgs), said, ids, lps))
        if i == retry_at:
            said, ids, lps = reply(per_call)
            script.calls.append(Call(list(msgs), said, ids, lps, retry=True))
        tool_output = "Tool output:\n" + chunk(rng.uniform(0.4, 1.1) * per_call)
        msgs += [Message("assistant", said), Message("user", tool_output)]
    return script


def record(store: SessionStore, script: Script) -> None:
    """Every call of ``script`` assembled and recorded in ``store`` (journaled, not written)."""
    for i, call in enumerate(script.calls):
        chat = ChatRequest(messages=call.messages, model="m", client_retry=call.retry)
        assembly = store.assemble(script.session_id, chat)
        turn = TurnRecord(
            session_id=script.session_id, request_id=f"chatcmpl-{script.session_id}-{i:04d}",
            turn_index=i, protocol="openai.chat", requested_model="qwen3", policy_model="Qwen/Qwen3-8B",
            backend="http://127.0.0.1:8000", user_agent="OpenAI/Python 1.99.0", prompt_ids=assembly.prompt_ids,
            completion_ids=call.ids, completion_logprobs=call.logprobs, finish_reason="stop",
            response_finish_reason="stop", started_at=1.7e9 + i, latency_s=0.5 + i / 100, stream=True,
            completion_text=call.text,
        )  # fmt: skip
        store.record(turn, assembly, Message("assistant", call.text))
