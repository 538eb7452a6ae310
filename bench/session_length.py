"""Placement cost per call as one session grows to thousands of calls.

    .venv/bin/python bench/session_length.py [--calls 6000] [--turns 4] [--tokenizer DIR]

A session can hold thousands of calls: a long-running agent, or every call of clients that send
no session name (they share ``anonymous``). Each new request is placed among the session's
calls (``ThreadSet.assemble``, then ``commit``). Here short tasks of ``--turns`` calls follow each
other in one session, like bench/paced.py's conversations: once with every reply the same text
("Done.", the case where a lookup by reply text finds every call), once with a different reply
each call. Printed: the median time per call (assemble and commit) in the 100 calls before
each mark, and its ratio to the first mark's, measured in the same run. Target: the last mark
costs no more than 1.5x the first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from capture.trajectory import ThreadSet  # noqa: E402
from rewriter.canonical import Message  # noqa: E402
from rewriter.template import ChatTemplate  # noqa: E402

WINDOW = 100  # calls per median


def per_call_seconds(
    template: ChatTemplate, calls: int, turns: int, same_reply: bool
) -> list[float]:
    threads = ThreadSet("bench", template)
    seconds: list[float] = []
    messages: list[Message] = []
    for n in range(calls):
        if n % turns == 0:
            messages = [Message("system", "You are a coding agent.")]
        messages.append(Message("user", f"Step {n % turns} of task {n // turns}."))
        text = "Done." if same_reply else f"Done with step {n}."
        sampled = template.encode(text) + [template.eos_token_id]
        start = time.perf_counter()
        assembly = threads.assemble(list(messages), [], None)
        threads.commit(
            assembly, Message("assistant", text), sampled, [-0.1] * len(sampled),
            request_id=str(n), turn_index=n % turns, finish_reason="stop", latency_s=0.0,
            backend="bench",
        )  # fmt: skip
        seconds.append(time.perf_counter() - start)
        messages.append(Message("assistant", text))
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=6000)
    parser.add_argument("--turns", type=int, default=4, help="calls per task")
    parser.add_argument("--tokenizer", default=str(REPO.parent / "shared" / "tokenizers" / "qwen3"))
    args = parser.parse_args()
    if args.calls < 2 * WINDOW:
        parser.error(f"--calls must be at least {2 * WINDOW}")
    template = ChatTemplate(args.tokenizer)
    marks = sorted({m for m in (WINDOW, 1000, 3000, args.calls) if WINDOW <= m <= args.calls})
    print(
        f"one session, tasks of {args.turns} calls, {args.calls} calls; "
        f"median ms per call (assemble + commit) over the {WINDOW} calls before each mark\n"
    )
    print(
        "| replies | "
        + " | ".join(f"call {m}" for m in marks)
        + f" | call {marks[-1]} / call {marks[0]} |"
    )
    print("|---|" + "---:|" * (len(marks) + 1))
    worst = 0.0
    for same_reply in (True, False):
        seconds = per_call_seconds(template, args.calls, args.turns, same_reply)
        medians = [statistics.median(seconds[m - WINDOW : m]) for m in marks]
        ratio = medians[-1] / medians[0]
        worst = max(worst, ratio)
        label = 'all "Done."' if same_reply else "each different"
        cells = " | ".join(f"{1e3 * m:.3f}" for m in medians)
        print(f"| {label} | {cells} | {ratio:.2f}x |")
    print(f"\nworst growth: {worst:.2f}x (target <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
