"""bench/agent_sessions.py's session plan: Claude-Code-shaped tools, a system prompt, a task and
tool results of 200 to 2,000 tokens, sized in Qwen3 tokens so the last call reaches the context
asked for."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
QWEN3 = Path(
    os.environ.get("AGENTTAP_QWEN3_TOKENIZER", REPO.parent / "shared" / "tokenizers" / "qwen3")
)
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
