"""Sessions: the calls of one scaffold run, journaled as they complete, sharded when it ends.

Durability: every completed call is appended to the session's journal (one compact JSON line,
``capture.storage.journal_lines``) before the client's response finishes, so a crash of the
proxy loses nothing; the fsync that makes it survive a crash of the host runs in a worker
thread, batched (``capture.storage.journal_sync``), right after the response or, with
``agenttap_journal_fsync=before_reply``, before it ends. The line holds the call's record and
how it changed its thread (what was kept, what replaced the rest), so threads can be rebuilt
from the journal alone. A session becomes Parquet shards (``turns/`` one row per call,
``threads/`` one training row per thread; ``capture.storage.rows``) when it has been idle for
``idle_timeout_s``, is flushed (``flush``: it goes on, its tree kept for the calls in flight and
the next ones), is closed, or the proxy stops; only then is its journal removed. A proxy killed with
``kill -9`` leaves journals behind, and the next start turns them into shards.

A call the policy failed (``FailedCall``) is journaled too, as a line of its own (``failed``),
and written to ``failed/``: counted per session, never part of a thread row.

When a trainer opens an id calls were made under before (capture/control/sessions.py ``open``),
``detach`` gives what they recorded a name of its own (its rows written, and shards written
already rewritten, under ``ID~unopened-HEX``), and ``record`` leaves out a call of the id that
began before that opening (``claimed_at``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# bench/storage.py times the store's journal writes by patching this module's ``_append``.
from capture.storage.journal_files import append_line as _append
from capture.storage.journal_files import (
    journal_name,
    make_text_safe,
    replay,
    safe_text,
)
from capture.storage.records import FailedCall, TurnRecord
from capture.storage.rows import RowAnnotations, thread_row, turn_row
from capture.storage.shards import (
    FAILED_SCHEMA,
    THREAD_SCHEMA,
    TURN_SCHEMA,
    write_rows,
)

# capture/rollouts/runner.py imports it from here.
from capture.storage.take_back import take_back_rewards as take_back_rewards
from capture.storage.written import WrittenShards
from capture.trajectory import (
    Assembly,
    Provenance,
    Renderer,
    ThreadRow,
    ThreadSet,
    export_rows,
)
from capture.trajectory.journal import call_entry
from capture.trajectory.orphans import as_new_tree, placed_in
from rewriter.canonical import ChatRequest, Message
from rewriter.ids_json import IdsJson

logger = logging.getLogger(__name__)

# Sessions whose threads are kept after an idle flush (about 58 bytes per token each).
DORMANT_SESSIONS = 64


@dataclass
class Session:
    session_id: str
    journal_path: Path
    threads: ThreadSet | None
    turns: list[TurnRecord] = field(default_factory=list)
    # Calls of this session the policy failed since its last write (not trained).
    failed: list[FailedCall] = field(default_factory=list)
    last_active: float = field(default_factory=time.monotonic)
    # The last recorded prompt's ids and JSON text: the next prompt's request body extends it.
    last_prompt: IdsJson | None = None


class SessionStore:
    def __init__(
        self,
        out_dir: Path,
        renderer: Renderer | None = None,
        idle_timeout_s: float = 300.0,
        recompute: bool = True,
    ) -> None:
        self.out_dir = out_dir
        self.renderer = renderer
        self.idle_timeout_s = idle_timeout_s
        self.recompute = recompute
        self.journal_dir = out_dir / "journal"
        self.turns_dir = out_dir / "turns"
        self.threads_dir = out_dir / "threads"
        self.failed_dir = out_dir / "failed"
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        self._sessions: dict[str, Session] = {}
        # The shards written per session, and its calls in shards (turn indices go on).
        self.written = WrittenShards(self.turns_dir, self.threads_dir, self.failed_dir)
        # Threads of sessions flushed while idle, most recent last (see end_session).
        self._dormant: OrderedDict[str, ThreadSet] = OrderedDict()
        # What a trainer said of a session (its metadata), written into every thread row of it.
        self.annotations_for: Callable[[str], RowAnnotations | None] = lambda _sid: None
        # When a session was opened over calls made before it (SessionControl.claimed_at): a
        # call of it that started by then is not recorded; on_dropped hears of each.
        self.claimed_at: Callable[[str], float | None] = lambda _sid: None
        self.on_dropped: Callable[[str], None] = lambda _sid: None

    def session(self, session_id: str) -> Session:
        sess = self._sessions.get(session_id)
        if sess is None:
            threads = self._dormant.pop(session_id, None) or (
                ThreadSet(session_id, self.renderer, self.recompute) if self.renderer else None
            )
            sess = Session(session_id, self.journal_dir / journal_name(session_id), threads)
            self._sessions[session_id] = sess
        return sess

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def knows(self, session_id: str) -> bool:
        """Whether this process has seen calls of ``session_id`` (live, or written already)."""
        return (
            session_id in self._sessions
            or session_id in self._dormant
            or self.written.knows(session_id)
        )

    def next_turn_index(self, session_id: str) -> int:
        return self.written.turns(session_id) + len(self.session(session_id).turns)

    def assemble(
        self, session_id: str, chat: ChatRequest, inline_budget: int | None = None
    ) -> Assembly:
        """``chat`` placed in its session's tree (``inline_budget``: see ThreadSet.assemble;
        NotInline when the request needs more)."""
        threads = self.session(session_id).threads
        assert threads is not None, "SessionStore needs a renderer to assemble prompts"
        return threads.assemble(
            chat.messages,
            chat.tools,
            chat.enable_thinking,
            client_retry=chat.client_retry,
            inline_budget=inline_budget,
        )

    def assemble_tokens(self, session_id: str, token_ids: list[int]) -> Assembly:
        threads = self.session(session_id).threads
        assert threads is not None, "SessionStore needs a renderer to assemble prompts"
        return threads.assemble_tokens(token_ids)

    def record(
        self,
        turn: TurnRecord,
        assembly: Assembly | None = None,
        reply: Message | None = None,
        rescored: list[float] | None = None,
        constrained: bool = False,
        durable: bool = True,
        prompt_json: str | None = None,
        rescored_version: str | None = None,
    ) -> Path:
        """Journal ``turn`` (written and, unless ``durable=False``, fsynced) and apply it to
        its thread; returns the journal written.

        ``constrained``: sampled under a JSON schema, so the sampler's logprobs are not the
        policy's; ``rescored`` are the policy's (prompt_logprobs), trained instead (provenance
        2). Without them the tokens are kept but masked (provenance 3). ``durable=False``: the
        line is written but not fsynced; the caller has it fsynced (``JournalSyncer``).
        ``prompt_json``: the JSON text the prompt's ids were sent as (``last_prompt``).
        ``rescored_version``: the weights that gave ``rescored``."""
        if self._began_before_claim(turn.session_id, turn.started_at, turn.request_id):
            return self.journal_dir / "not-recorded.jsonl"  # nothing to fsync
        make_text_safe(turn)
        sess = self.session(turn.session_id)
        entry: dict[str, Any] = {}
        if assembly is not None and reply is not None and sess.threads is not None:
            if constrained:
                provenance = Provenance.RECOMPUTED if rescored is not None else Provenance.STALE
                turn.metadata["constrained"] = "json_schema"
            else:
                provenance = Provenance.SAMPLED
            if rescored is not None:
                versions = [(rescored_version or "", 0, len(turn.completion_ids))]
            else:
                versions = [(w["version"], w["start"], w["end"]) for w in turn.weight_versions]
            if not placed_in(sess.threads, assembly):
                assembly = self._orphan(turn, assembly)
            call = sess.threads.commit(
                assembly,
                reply,
                turn.completion_ids,
                rescored if rescored is not None else turn.completion_logprobs,
                sampled_provenance=provenance,
                sampled_versions=versions,
                request_id=turn.request_id,
                turn_index=turn.turn_index,
                finish_reason=turn.finish_reason,
                latency_s=turn.latency_s,
                backend=turn.backend,
            )
            turn.metadata["assembly"] = assembly.kind
            # Enough to rebuild the call's place in the tree from the journal alone.
            entry = call_entry(call)
        # Compact: its prompt as the journal's earlier call it extends plus the new ids.
        entry = {"turn": turn.to_row(), "call": entry}
        _append(sess.journal_path, entry, sess.turns, fsync=durable)
        sess.turns.append(turn)
        if prompt_json is not None:  # the JSON text of turn.prompt_ids, as it was sent
            sess.last_prompt = IdsJson(turn.prompt_ids, prompt_json)
        sess.last_active = time.monotonic()
        return sess.journal_path

    def _orphan(self, turn: TurnRecord, assembly: Assembly) -> Assembly:
        """A call placed in a tree this session no longer has (written and let go while the call
        was in flight: the session was closed, or its tree was the least recently used of the
        idle ones kept): it starts a tree of its own (capture/trajectory/orphans.py)."""
        logger.warning(
            "agenttap: call %s of session %r ended after the tree it was placed in was written "
            "and let go (the session was closed, or idle past agenttap_idle_timeout, while the "
            "call was in flight): its row starts a new thread, the history before it as context",
            turn.request_id,
            turn.session_id,
        )
        return as_new_tree(assembly)

    def _began_before_claim(self, session_id: str, started_at: float, request_id: str) -> bool:
        """Whether a call of ``session_id`` began before a trainer opened the id over calls
        made before: it is not that session's, and not recorded (logged, counted dropped)."""
        claimed = self.claimed_at(session_id)
        if claimed is None or started_at > claimed:
            return False
        logger.warning(
            "agenttap: call %s of session %r is not recorded: it began before the session was "
            "opened (POST /sessions or /rollouts), without its secret, and ended after; the "
            "rows of calls made before the opening are kept apart (session id %r...)",
            request_id,
            session_id,
            session_id + "~unopened-",
        )
        self.on_dropped(session_id)
        return True

    def last_prompt(self, session_id: str) -> IdsJson | None:
        """The session's last recorded prompt and its JSON text (None: none yet)."""
        sess = self._sessions.get(session_id)
        return sess.last_prompt if sess is not None else None

    def record_failure(self, failed: FailedCall) -> None:
        """Journal a call the policy failed. Nothing of it reaches a thread: its tokens are
        not trained, and the session's trained calls are untouched."""
        if self._began_before_claim(failed.session_id, failed.started_at, failed.request_id):
            return
        failed.reason = safe_text(failed.reason)
        failed.user_agent = safe_text(failed.user_agent)
        failed.requested_model = safe_text(failed.requested_model)
        sess = self.session(failed.session_id)
        _append(sess.journal_path, {"failed": failed.to_row()})
        sess.failed.append(failed)
        sess.last_active = time.monotonic()

    def failed_calls(self, session_id: str) -> int:
        """How many of the session's calls the policy failed since its last write."""
        sess = self._sessions.get(session_id)
        return len(sess.failed) if sess is not None else 0

    def touch(self, session_id: str) -> None:
        self.session(session_id).last_active = time.monotonic()

    # -- ending sessions -------------------------------------------------------------------
    def flush_idle(self, now: float | None = None, skip: Set[str] = frozenset()) -> list[Path]:
        """Write the sessions idle past the timeout, but those in ``skip`` (busy)."""
        now = time.monotonic() if now is None else now
        idle = [
            s
            for s in self._sessions.values()
            if now - s.last_active >= self.idle_timeout_s and s.session_id not in skip
        ]
        return [
            p for s in idle for p in self.end_session(s.session_id, keep_threads=True, why="idle")
        ]

    def pending_rows(self, session_id: str) -> list[dict[str, Any]]:
        """The thread rows ``session_id`` would write now (calls not written yet), without
        writing them or marking anything written."""
        sess = self._sessions.get(session_id)
        if sess is None or sess.threads is None or not sess.turns:
            return []
        rows, thread_of = export_rows(list(sess.threads.calls))
        by_request = {t.request_id: t for t in sess.turns}
        out = [thread_row(session_id, row, by_request) for row in rows]
        annotations = self.annotations_for(session_id)
        for row in out:
            if annotations is not None:
                annotations.apply(row)
        return out

    def pending_turns(self, session_id: str) -> list[dict[str, Any]]:
        """The turns rows of ``session_id``'s calls not written yet, as they would be written
        (the viewer shows a live session's calls before its shards exist)."""
        sess = self._sessions.get(session_id)
        return [turn_row(t) for t in sess.turns] if sess is not None else []

    def written_threads(self, session_id: str, forget: bool = False) -> list[Path]:
        """The thread shards written for ``session_id`` by this process (shards hold rows of
        one session each); ``forget``: the session is over, stop remembering them."""
        return self.written.threads(session_id, forget)

    def end_session(
        self,
        session_id: str,
        keep_threads: bool = False,
        annotations: RowAnnotations | None = None,
        rows_out: list[dict[str, Any]] | None = None,
        why: str = "stop",
    ) -> list[Path]:
        """Write the session's shards. ``keep_threads``: the session may go on (idle flush), so
        its threads stay in memory and a later call extends their exact ids. ``annotations``:
        written into its thread rows (else ``annotations_for`` the session's); the rows written
        are appended to ``rows_out``. ``why`` (idle, flush, close, stop) is said in the log."""
        sess = self._sessions.pop(session_id, None)
        if sess is None:
            return []
        if keep_threads and sess.threads is not None:
            # Kept even when nothing is left to write: a call in flight was placed in this tree
            # and is committed to it when it ends (session() takes it back).
            self._dormant[session_id] = sess.threads
            self._dormant.move_to_end(session_id)
            while len(self._dormant) > DORMANT_SESSIONS:
                self._dormant.popitem(last=False)
        return self._write_session(sess, annotations, rows_out, why)

    def flush(self, session_id: str) -> list[Path]:
        """Write what ``session_id``'s calls recorded so far, and go on as before: the session
        stays live, its tree in memory, so that the calls in flight and the next ones are placed
        and committed in it as if nothing had been written (a row written now is continued by a
        row parented to it). The calls written are no longer the journal's: a new one starts."""
        sess = self._sessions.get(session_id)
        if sess is None:
            return []
        paths = self._write_session(sess, None, None, "flush")
        if sess.turns or sess.failed:
            sess.turns, sess.failed = [], []
            sess.journal_path = self.journal_dir / journal_name(session_id)
        return paths

    def _write_session(
        self,
        sess: Session,
        annotations: RowAnnotations | None,
        rows_out: list[dict[str, Any]] | None,
        why: str,
    ) -> list[Path]:
        """Write the shards of ``sess``'s calls not written yet, then remove its journal."""
        session_id = sess.session_id
        if not (sess.turns or sess.failed):
            return []
        if annotations is None:
            annotations = self.annotations_for(session_id)
        rows, thread_of = sess.threads.export() if sess.threads else ([], {})
        stem = sess.journal_path.stem
        paths = self._write(sess.turns, rows, thread_of, stem, annotations, rows_out)
        paths += self._write_failed(sess.failed, stem)
        self.written.add(session_id, paths, len(sess.turns))
        sess.journal_path.unlink(missing_ok=True)
        logger.info(
            "agenttap: session %r written (%s): %d calls in %d thread rows%s, in %s",
            session_id,
            why,
            len(sess.turns),
            len(rows),
            f" ({len(sess.failed)} failed by the policy, in failed/)" if sess.failed else "",
            self.out_dir,
        )
        return paths

    def detach(self, session_id: str, new_id: str, write: bool = True) -> int:
        """Keep what calls under ``session_id`` recorded so far (this process) apart, as
        session ``new_id``: a trainer opened ``session_id`` now, and its session starts empty
        (no earlier thread extended, no earlier row among its rows, its turns counted on).
        Calls not written yet are written now as ``new_id``'s rows (``write=False``: a worker
        thread is placing a call in its tree; the idle sweep writes them); shards written
        already are rewritten with ``session_id`` ``new_id``. Returns how many calls moved."""
        moved = 0
        sess = self._sessions.pop(session_id, None)
        if sess is not None and (sess.turns or sess.failed):
            moved += len(sess.turns) + len(sess.failed)
            sess.session_id = new_id
            for turn in sess.turns:
                turn.session_id = new_id
            for failed in sess.failed:
                failed.session_id = new_id
            self._sessions[new_id] = sess
            if write:
                self.end_session(new_id, why="kept apart: the id was opened")
            else:  # written by the idle sweep, long after the worker thread is done with it
                sess.last_active = time.monotonic()
        self._dormant.pop(session_id, None)
        moved += self.written.rename(session_id, new_id)
        if moved:
            logger.warning(
                "agenttap: session %r was opened after %d call(s) were made under its id "
                "without its secret (a proxy username or base URL nobody had opened): their "
                "rows are kept apart as session %r, never with the opened session's metadata "
                "or reward",
                session_id,
                moved,
                new_id,
            )
        return moved

    def _write(
        self,
        turns: list[TurnRecord],
        rows: list[ThreadRow],
        thread_of: dict[str, str],
        stem: str,
        annotations: RowAnnotations | None = None,
        rows_out: list[dict[str, Any]] | None = None,
    ) -> list[Path]:
        """Write a journal's calls as shards named after the journal (``stem``): a crash at any
        point of these writes leaves the journal, and writing it again on restart replaces the
        files already written, so every row lands exactly once."""
        for turn in turns:
            turn.thread_id = thread_of.get(turn.request_id, turn.thread_id)
        by_request = {t.request_id: t for t in turns}
        turn_rows = [turn_row(t) for t in turns]
        paths = write_rows(self.turns_dir, turn_rows, TURN_SCHEMA, "turns", stem=stem)
        if turns and rows:
            session_id = turns[0].session_id
            shard_rows = [thread_row(session_id, row, by_request) for row in rows]
            if annotations is not None:
                for shard_row in shard_rows:
                    annotations.apply(shard_row)
            if rows_out is not None:
                rows_out.extend(shard_rows)
            paths += write_rows(self.threads_dir, shard_rows, THREAD_SCHEMA, "threads", stem=stem)
        return paths

    def _write_failed(self, failed: list[FailedCall], stem: str) -> list[Path]:
        # Named after the journal like the others: a repeated write replaces, never adds.
        rows = [f.to_row() for f in failed]
        return write_rows(self.failed_dir, rows, FAILED_SCHEMA, "failed", stem=stem)

    def close(self) -> list[Path]:
        return [p for sid in list(self._sessions) for p in self.end_session(sid)]

    # -- recovery after a crash ------------------------------------------------------------
    def recover(self) -> list[Path]:
        """Turn journals left by an earlier process into shards. CallNode before serving."""
        self.written.count_from_shards()
        written: list[Path] = []
        for journal in sorted(self.journal_dir.glob("*.jsonl")):
            try:
                written += self._recover_journal(journal)
            except Exception:
                # One bad journal must not keep the proxy from starting, nor hide the others:
                # it is kept aside, whole, for a person to look at.
                bad = journal.with_suffix(".bad")
                journal.replace(bad)
                logger.exception(
                    "could not write the shards of %s; kept as %s (the other sessions are "
                    "recovered)",
                    journal.name,
                    bad,
                )
                continue
            journal.unlink()
        return written

    def _recover_journal(self, journal: Path) -> list[Path]:
        turns, failed, calls = replay(journal)
        written = self._write_failed(failed, journal.stem)
        if not turns:
            return written
        rows, thread_of = export_rows(list(calls.values()))
        written += self._write(turns, rows, thread_of, journal.stem)
        # A session that goes on after the restart keeps counting its calls.
        self.written.count(turns[0].session_id, max(t.turn_index for t in turns) + 1)
        logger.info("recovered %d calls from %s", len(turns), journal.name)
        return written
