"""The real Claude Code CLI through the real proxy, its first answer empty (the scripted policy
samples only the end token): Claude Code asks again with "[Your previous response had no visible
output...]" appended to its user message. The two calls are one rollout: the empty answer's row is
a dead end (``dead_reason`` ``empty``) hung off the retry's row (``parent_relation`` ``retry``),
and ``to_rl_batch`` batches the retry's row alone (issue 40)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from capture.storage.reader import to_rl_batch
from capture.train.rows import main_row
from tests.e2e.clis.test_claude_code import claude, run_claude  # noqa: F401 - the claude fixture
from tests.support.paths import IM_END
from tests.support.proxies import Proxy
from tests.support.stub_vllm import StubPolicy

NUDGE = "[Your previous response had no visible output."


def test_an_empty_answer_and_claude_codes_retry_are_one_rollout(
    claude: Path,  # noqa: F811
    stub_proxy: Proxy,
    stub: StubPolicy,
    tok: Any,
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    stub.replies.clear()
    stub.script("", "Hello after the retry.")
    n = len(stub.requests)
    session = "cc-empty-retry"
    done = run_claude(claude, stub_proxy, session, workdir, "Say hello.")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Hello after the retry." in done.stdout
    # What Claude Code sent: the same request, its user message with the nudge appended.
    first, second = (tok.decode(r["prompt"]) for r in stub.requests[n : n + 2])
    assert NUDGE not in first and NUDGE in second
    turns = {t["completion_text"]: t for t in stub_proxy.turns(session, expect=2)}
    assert turns[""]["completion_ids"] == [IM_END]
    rows = {r["thread_id"]: r for r in stub_proxy.threads(session, expect=2)}
    empty = rows[turns[""]["thread_id"]]
    live = rows[turns["Hello after the retry."]["thread_id"]]
    assert empty["dead"] and empty["dead_reason"] == "empty"
    assert empty["parent_relation"] == "retry" and empty["parent_thread_id"] == live["thread_id"]
    assert empty["superseded_by"] == live["thread_id"]
    assert not live["dead"] and live["parent_thread_id"] is None
    # A trainer sees one conversation: the retry's.
    batch = to_rl_batch(list(rows.values()), pad_id=0, missing_reward="zero")
    assert batch["thread_id"] == [live["thread_id"]]
    picked = main_row(list(rows.values()))
    assert picked is not None and picked["thread_id"] == live["thread_id"]
