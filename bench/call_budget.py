"""Where a call's proxy CPU goes (issue 52): agenttap's CPU per call, split by the step of the
call that spends it.

    .venv/bin/python bench/call_budget.py [--clients 48] [--pace-ms 2] [--tokens 64] [--seconds 40]

It runs ``bench/paced.py --only agenttap`` (its clients, its vLLM-shaped stub, its pace) and,
once the streams run, samples the agenttap mitmdump with py-spy (``py-spy record --format raw
--nonblocking``: every thread's Python stacks, 200 a second, the process never paused) for the
path's time less 10 seconds. Each sample is charged to a step by its innermost frame that
belongs to one (``STEPS``, in the order a call meets them); a worker thread waiting in an fsync,
or idle, is left out (no CPU). The table gives each step's share of the samples and, with the
CPU per token paced.py measured in the same run (``/proc``: every thread, user and system)
times the answer's tokens, its milliseconds of proxy CPU per call. C code (the TLS library,
orjson, the tokenizer) is charged to the Python frame that called it.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY_SPY = Path(sys.executable).parent / "py-spy"

# The steps of a call, each by the files (or functions) whose frames are its work.
STEPS = (
    ("record: the journal line, the fsync's hand-off, the session's rows",
     r"capture/storage/|capture/pipeline/recording"),
    ("place: the new text rendered and tokenized, the thread it extends",
     r"capture/trajectory/|rewriter/template|tokenizers|TurnPipeline\._place|TurnPipeline\.assemble"),
    ("read + parse: the request's body, the provider's parse, the session",
     r"capture/pipeline/bodies|rewriter/providers/[^ ]*/(request|serving)|rewriter/jsonbody"
     r"|capture/pipeline/session_ids|TurnPipeline\._prepare"),
    ("policy: the request to vLLM, its stream read and parsed",
     r"rewriter/vllm_|aiohttp/client|aiohttp/streams|capture/policy/"),
    ("answer: the provider's events, written to the hop",
     r"rewriter/providers/|TurnPipeline\._serve_http\.<locals>\.send|aiohttp/web_response"
     r"|aiohttp/http_writer"),
    ("hop: the gateway's side of the loopback (aiohttp's server)",
     r"aiohttp/web_|aiohttp/http_parser|aiohttp/_http_parser|capture/gateway\.py"),
    ("mitmproxy: the client's TLS and HTTP/1, addon hooks, the hop's client side, the relay",
     r"mitmproxy/|OpenSSL/|cryptography/"),
)  # fmt: skip
OTHER = "event loop: epoll, callbacks, the rest"
# Frames that run every callback, whoever's it is.
OUTER = re.compile(
    r"^<module> \(|\((mitmproxy/tools/main\.py|asyncio/(runners|base_events|events)\.py|threading\.py"
    r"|concurrent/futures/thread\.py):"
)
FRAME = re.compile(r"(.*) \((.*):\d+\)$")


def budget(raw: str) -> tuple[collections.Counter[str], int, collections.Counter[str]]:
    """py-spy's raw stacks (``frame;frame;... COUNT`` per line) as samples per step, how many
    were left out (fsync waits, idle workers), and the innermost frames of the rest."""
    steps: collections.Counter[str] = collections.Counter()
    rest: collections.Counter[str] = collections.Counter()
    left_out = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";") if stack else ["(no Python frame: C code or the kernel)"]
        if any("sync_journal" in f for f in frames) or re.match(r"(_worker|.*wait) \(", frames[-1]):
            left_out += int(count)
            continue
        # The frames around every callback (mitmdump's main, the loop's run, a thread's start)
        # are everyone's: only the others say whose work a sample is.
        inner = [f for f in frames if not OUTER.search(f)]
        step = OTHER
        for frame in reversed(inner):
            hit = next((name for name, pattern in STEPS if re.search(pattern, frame)), None)
            if hit is not None:
                step = hit
                break
        steps[step] += int(count)
        if step == OTHER:
            rest[" < ".join(frames[-1:-4:-1])] += int(count)
    return steps, left_out, rest


def agenttap_pid(parent: int) -> int | None:
    """The agenttap mitmdump that ``parent`` started (its child running addons/capture.py)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and any(a.endswith(b"addons/capture.py") for a in cmdline):
            return int(entry.name)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--pace-ms", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()
    if not PY_SPY.exists():
        print(f"call_budget: {PY_SPY} is missing: run scripts/setup.sh (py-spy is a dev package)")
        return 2
    paced = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "paced.py"), "--only", "agenttap",
         "--clients", str(args.clients), "--pace-ms", str(args.pace_ms),
         "--tokens", str(args.tokens), "--seconds", str(args.seconds)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert paced.stdout is not None
    out: list[str] = []
    for line in paced.stdout:  # its first line comes once every server is up
        out.append(line)
        print(line, end="", flush=True)
        if "clients, a token every" in line:
            break
    pid = agenttap_pid(paced.pid)
    if pid is None:
        paced.kill()
        print("call_budget: paced.py started no agenttap mitmdump:\n" + "".join(out))
        return 1
    time.sleep(5)  # the clients' first calls (TLS handshakes, sessions opened) apart
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "stacks.txt"
        spy = subprocess.run(
            [str(PY_SPY), "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
             "--nonblocking", "--duration", str(int(args.seconds - 10)), "-o", str(raw)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        stacks = raw.read_text() if raw.exists() else ""
    rest = paced.stdout.read()
    paced.wait()
    print(rest, end="")
    found = re.search(r"agenttap, \d+ tokens: \S+ tokens/s, (\S+) µs/token", rest)
    steps, left_out, rest = budget(stacks)
    total = sum(steps.values())
    if found is None or total == 0:
        print(f"call_budget: no measurement (py-spy: {spy.stderr.strip()[-500:]})")
        return 1
    per_call_ms = float(found.group(1)) * args.tokens / 1000
    print(
        f"\nagenttap's proxy CPU per call: {per_call_ms:.2f} ms ({args.tokens}-token answers, "
        f"{args.clients} clients, a token every {args.pace_ms:g} ms); {total} samples "
        f"({left_out} left out: fsync waits, idle workers)\n"
    )
    print("| step of a call | share of the samples | ms of CPU per call |")
    print("|---|---:|---:|")
    for name, count in steps.most_common():
        print(f"| {name} | {100 * count / total:.1f}% | {per_call_ms * count / total:.2f} |")
    print(f"\n{OTHER}: its most sampled frames (innermost first)")
    for frames, count in rest.most_common(8):
        print(f"  {100 * count / total:4.1f}%  {frames}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
