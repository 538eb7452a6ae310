"""Record a real client's traffic through the addon into a mitmproxy flow file, and replay that
file offline through the addon again (``mitmdump -n -C FILE``): reusable for any client/protocol.

    with recording(stub.url, tmp / "live", confdir, tmp / "calls.flows") as proxy:
        run_the_client(proxy.env("session"))            # any real client, through the proxy
    stub.script(*recorded_replies(tmp / "live"))          # the policy answers the same again
    replay = replay_flows(tmp / "calls.flows", stub.url, tmp / "replayed", confdir)
    assert thread_signatures(tmp / "replayed") == thread_signatures(tmp / "live")

The saved flows hold the client's original requests (e.g. ``https://api.openai.com/...``) with
no API key, no gateway header, and the session id in ``flow.metadata["agenttap_session"]``.
Both steps load ``tests/support/dial_guard.py``: every server connection is logged and any that is not
loopback is killed, so ``Replay.dials`` / ``dials(log)`` prove nothing went out.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.paths import CAPTURE, MITMDUMP, QWEN3, REPO
from tests.support.proxies import Proxy, agenttap_options, read_threads, read_turns, start_proxy

DIAL_GUARD = REPO / "tests" / "support" / "dial_guard.py"
# Shards are written once, when the proxy stops, so a thread is never split across flushes.
NO_IDLE_FLUSH = 3600


def dials(log: str) -> list[str]:
    """Every server connection the dial guard saw: ``"loopback 127.0.0.1:PORT"`` or
    ``"REFUSED host:port"``."""
    from tests.support.dial_guard import MARK

    return [line.split(MARK, 1)[1].strip() for line in log.splitlines() if MARK in line]


@contextmanager
def recording(
    policy_url: str,
    out: Path,
    confdir: Path,
    flow_file: Path,
    tokenizer: Path = QWEN3,
    extra: list[str] | None = None,
) -> Iterator[Proxy]:
    """A live proxy that also writes every flow to ``flow_file`` (streamed bodies included).
    Stopped on exit, so the flow file is closed and the shards are written."""
    args = [
        "-s", str(DIAL_GUARD),
        "-w", str(flow_file),
        "--set", "store_streamed_bodies=true",
        *(extra or []),
    ]  # fmt: skip
    proxy = start_proxy(
        policy_url, out, confdir, tokenizer=tokenizer, extra=args, idle_timeout=NO_IDLE_FLUSH
    )
    try:
        yield proxy
    finally:
        proxy.stop()


@dataclass
class Replay:
    returncode: int
    log: str
    seconds: float

    @property
    def dials(self) -> list[str]:
        return dials(self.log)


def replay_flows(
    flow_file: Path,
    policy_url: str,
    out: Path,
    confdir: Path,
    tokenizer: Path = QWEN3,
    extra: list[str] | None = None,
    timeout: float = 180,
) -> Replay:
    """Client-replay ``flow_file`` through the addon, offline: no proxy listens (``-n``), requests
    go one after the other and mitmdump exits when the last one is answered."""
    import time

    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}-replay.log"
    cmd = [
        str(MITMDUMP), "-n", "-C", str(flow_file),
        "-s", str(CAPTURE), "-s", str(DIAL_GUARD),
        *agenttap_options(policy_url, out, confdir, tokenizer, NO_IDLE_FLUSH),
        *(extra or []),
    ]  # fmt: skip
    start = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout)
    return Replay(proc.returncode, log.read_text(errors="replace"), time.monotonic() - start)


def read_flows(flow_file: Path) -> list[Any]:
    """The flows of a flow file (``mitmproxy.http.HTTPFlow`` objects), in file order."""
    import warnings

    with warnings.catch_warnings():  # mitmproxy's flow filters use deprecated pyparsing names
        warnings.simplefilter("ignore", DeprecationWarning)
        from mitmproxy import io

    with open(flow_file, "rb") as fh:
        return list(io.FlowReader(fh).stream())


def recorded_replies(out: Path, session: str | None = None) -> list[str]:
    """The policy's texts in call order: script a stub with these to answer a replay the same."""
    return [row["completion_text"] for row in read_turns(out, session)]


def thread_signatures(
    out: Path, session: str | None = None, logprobs: bool = True
) -> list[dict[str, Any]]:
    """What must not change between a recording and its replay: every thread's tokens, mask,
    provenance and turn layout (request and thread ids are new on each run, so threads are
    ordered by their first call and parents are named by that order)."""
    threads = read_threads(out, session)
    threads.sort(key=lambda t: (t["session_id"], min(s["turn_index"] for s in t["turns"])))
    order = {(t["session_id"], t["thread_id"]): i for i, t in enumerate(threads)}
    sigs = []
    for t in threads:
        sig = {
            "session_id": t["session_id"],
            "parent": order.get((t["session_id"], t["parent_thread_id"])),
            "has_parent_tool_call": t["parent_tool_call_id"] is not None,
            "num_turns": t["num_turns"],
            "protocol": t["protocol"],
            "input_ids": t["input_ids"],
            "loss_mask": t["loss_mask"],
            "provenance": t["provenance"],
            "turns": [
                (s["turn_index"], s["start"], s["end"], s["finish_reason"], s["dropped"])
                for s in t["turns"]
            ],
        }
        if logprobs:
            sig["logprobs"] = t["logprobs"]
        sigs.append(sig)
    return sigs
