"""Issue 10 item 3: a crash at any step of a shard write (before a file, between writing and
renaming it, between the turns and threads shards, before the journal is removed), then recovery
(itself run twice), leaves each turn and thread row exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

import capture.storage.shards
from capture.storage.sessions import SessionStore
from rewriter.canonical import ChatRequest, Message
from rewriter.template import ChatTemplate
from tests.support.proxies import read_threads, read_turns, record_turn

TURNS = 5


class Killed(BaseException):
    """Stands in for kill -9: nothing after it runs."""


def _session(store: SessionStore, template: ChatTemplate, session: str) -> None:
    msgs = [Message("system", "s"), Message("user", "q0")]
    for i in range(TURNS):
        ids = template.encode(f"answer {i}") + [template.eos_token_id]
        record_turn(store, session, ChatRequest(messages=list(msgs), model="m"), ids, i)
        msgs += [Message("assistant", f"answer {i}"), Message("user", f"q{i + 1}")]


# Each step of SessionStore.end_session: (function patched, how many calls succeed first).
CRASH_POINTS = [
    ("write_table", 0),  # before the turns file is written
    ("replace", 0),  # turns file written under its temporary name, not renamed
    ("write_table", 1),  # turns shard in place, threads shard not written
    ("replace", 1),  # threads shard written, not renamed
    ("unlink", 0),  # both shards in place, journal not yet removed
]


@pytest.mark.parametrize(("step", "succeed"), CRASH_POINTS)
def test_crash_at_each_write_step_recovers_rows_exactly_once(
    step: str, succeed: int, qwen3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = ChatTemplate(qwen3_dir)
    out = tmp_path / "out"
    store = SessionStore(out, template)
    _session(store, template, "sess")
    calls = {"n": 0}

    def crashing(real):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            if calls["n"] >= succeed:
                raise Killed
            calls["n"] += 1
            return real(*args, **kwargs)

        return wrapper

    with monkeypatch.context() as patch:
        if step == "write_table":
            patch.setattr(
                capture.storage.shards.pq,
                "write_table",
                crashing(capture.storage.shards.pq.write_table),
            )
        elif step == "replace":
            patch.setattr(
                capture.storage.shards.os, "replace", crashing(capture.storage.shards.os.replace)
            )
        else:
            patch.setattr(Path, "unlink", crashing(Path.unlink))
        with pytest.raises(Killed):
            store.end_session("sess")
    assert list((out / "journal").glob("*.jsonl")), "the journal must outlive a failed write"
    # Restart twice: recovery itself may be interrupted and run again.
    SessionStore(out, template).recover()
    SessionStore(out, template).recover()
    turns, threads = read_turns(out), read_threads(out)
    assert sorted(t["request_id"] for t in turns) == [f"r{i}" for i in range(TURNS)]
    assert len(threads) == 1 and len(threads[0]["turns"]) == TURNS
    assert not list((out / "journal").glob("*.jsonl"))
