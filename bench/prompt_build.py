"""Prompt-build time per turn over a 200-turn, ~64k-token conversation, and memory per token.

    .venv/bin/python bench/prompt_build.py [--turns 200] [--tokenizer DIR]

Compares agenttap's assembly (thread ids + closing tokens + only the new messages rendered)
with a naive full re-render of the whole history, measured in the same run, and prints a table.
Target: the 200th turn costs no more than 1.5x the 10th.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from capture.trajectory import ThreadSet  # noqa: E402
from rewriter.canonical import Message, ToolCall, ToolSpec  # noqa: E402
from rewriter.template import ChatTemplate  # noqa: E402

TOOLS = [
    ToolSpec(
        "bash", "Run a shell command", {"type": "object", "properties": {"cmd": {"type": "string"}}}
    )
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--tokenizer", default=str(REPO.parent / "shared" / "tokenizers" / "qwen3"))
    parser.add_argument("--repeat", type=int, default=5, help="timings per turn (median)")
    args = parser.parse_args()
    template = ChatTemplate(args.tokenizer)
    ours, naive, tokens, _ = run(template, args.turns, args.repeat, trace=False)
    # Memory in a separate pass: tracemalloc slows allocation and would skew the timings.
    _, _, _, mem = run(template, args.turns, 1, trace=True, naive_at=())
    report(args.turns, ours, naive, tokens, mem)


def run(
    template: ChatTemplate,
    turns: int,
    repeat: int,
    trace: bool,
    naive_at: tuple[int, ...] | None = None,
) -> tuple[dict[int, float], dict[int, float], int, int]:
    naive_at = (10, 50, 100, 150, turns) if naive_at is None else naive_at
    threads = ThreadSet("bench", template)
    msgs = [
        Message("system", "You are a coding agent. " * 20),
        Message("user", "Fix the bug in the parser."),
    ]
    tool_output = "\n".join(f"line {i}: some file content here with tokens" for i in range(28))
    ours: dict[int, float] = {}
    naive: dict[int, float] = {}
    tokens = 0
    if trace:
        tracemalloc.start()
    mem_before = tracemalloc.get_traced_memory()[0] if trace else 0
    for turn in range(1, turns + 1):
        timings = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            assembly = threads.assemble(msgs, TOOLS, None)
            timings.append(time.perf_counter() - t0)
        ours[turn] = statistics.median(timings)
        if turn in naive_at:
            t0 = time.perf_counter()
            template.render(msgs, TOOLS)
            naive[turn] = time.perf_counter() - t0
        text = f'<tool_call>\n{{"name": "bash", "arguments": {{"cmd": "cat file_{turn}.py"}}}}\n</tool_call>'
        sampled = template.encode(text) + [template.eos_token_id]
        reply = Message(
            "assistant",
            "",
            tool_calls=(ToolCall(f"c{turn}", "bash", f'{{"cmd": "cat file_{turn}.py"}}'),),
        )
        call = threads.commit(
            assembly, reply, sampled, [-0.1] * len(sampled), request_id=str(turn), turn_index=turn,
            finish_reason="stop", latency_s=0.0, backend="bench",
        )  # fmt: skip
        tokens = call.seq_len
        # The scaffold re-serializes the arguments and renames the id before sending them back.
        echoed = Message(
            "assistant",
            "",
            tool_calls=(ToolCall(f"toolu_{turn}", "bash", f'{{"cmd":"cat file_{turn}.py"}}'),),
        )
        msgs += [echoed, Message("tool", tool_output, tool_call_id=f"toolu_{turn}")]
    mem = 0
    if trace:
        mem = tracemalloc.get_traced_memory()[0] - mem_before
        tracemalloc.stop()
    return ours, naive, tokens, mem


def report(
    turns: int, ours: dict[int, float], naive: dict[int, float], tokens: int, mem: int
) -> None:
    print(f"conversation: {turns} turns, {tokens} tokens in the thread\n")
    print(
        f"{'turn':>6} | {'agenttap ms':>12} | {'full re-render ms':>18} | {'ratio naive/ours':>16}"
    )
    print("-" * 62)
    for turn in sorted(naive):
        print(
            f"{turn:>6} | {ours[turn] * 1e3:>12.3f} | {naive[turn] * 1e3:>18.3f} | {naive[turn] / ours[turn]:>16.1f}"
        )
    ratio = ours[turns] / ours[10]
    window = statistics.median(ours[t] for t in range(turns - 9, turns + 1)) / statistics.median(
        ours[t] for t in range(6, 16)
    )
    print(
        f"\nturn {turns} / turn 10 (agenttap): {ratio:.2f}x; medians of turns around them: {window:.2f}x (target <= 1.5x)"
    )
    print(f"memory per stored token (thread state, tracemalloc): {mem / max(tokens, 1):.1f} bytes")


if __name__ == "__main__":
    main()
