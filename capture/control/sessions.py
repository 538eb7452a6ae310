"""Sessions a trainer drives: opened with metadata and limits, counted, closed with a reward.

Pure bookkeeping, no HTTP: ``capture/control/api.py`` serves it, ``capture/pipeline/turn.py``
asks it before each call (``refusal``) and tells it what each call did (``note_call``,
``note_failure``). A session nobody opened (a proxy username, a base URL with a new name) is
counted too, so ``GET /sessions`` and the metrics at close cover every session; only an opened
one has metadata and limits.

An id is claimed when it is opened: from then on every call naming it must carry its secret
(whatever agenttap_require_session_secret says; that option only decides whether ids nobody
opened are served at all). What calls made under the id before it was opened recorded never
joins the opened session: ``open`` starts it empty and hands the earlier activity a name of its
own (``kept_apart_id``: ``ID~unopened-HEX``), under which the store writes those rows
(``on_claim``, SessionStore.detach); a call that began before the open and ends after it is not
recorded at all (``claimed_at``, SessionStore.record).

Limits end an agent's loop: past ``max_calls`` model calls, ``max_tokens`` sampled tokens or
``deadline_s`` seconds after opening, the next call is refused with an answer its client treats
as final (the provider's words, see ``Provider.session_ended``). A call in flight is never cut;
a call's ``max_tokens`` is lowered to what is left of the budget, so the budget holds exactly.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from capture.isolation.limits import SESSION_LIMIT_KEYS, reject_unknown


class EndReason(StrEnum):
    """Why a session ended, as its rows say (``end_reason``)."""

    STOP = "stop"  # the trainer closed it: the agent stopped by itself
    MAX_CALLS = "max_calls"
    MAX_TOKENS = "max_tokens"
    DEADLINE = "deadline"
    # A closed session's calls are refused too (its rows are written).
    CLOSED = "closed"
    # Its first call was answered more than agenttap_max_staleness weight updates ago.
    STALE = "stale"


SPLITS = ("train", "val")
# Closed sessions remembered for late rewards and refusals (oldest forgotten first).
CLOSED_KEPT = 100_000
# Sessions nobody opened, idle and written, still answered by GET /sessions/{id}.
PAST_KEPT = 100_000
# Rows of calls made under an id before it was opened are kept apart under ID + this + hex: a
# name no trainer can open (an opened id never holds "~"), unique by its random part.
KEPT_APART = "~unopened-"
# What a session id may hold: it names a URL path segment and a journal file.
# (It is also a proxy URL's username, where ':' and '@' would end it.)
# Matched whole (fullmatch): "$" would let a trailing newline through.
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True)
class Limits:
    max_calls: int | None = None
    max_tokens: int | None = None
    deadline_s: float | None = None


def _seed_of(*parts: bytes) -> int:
    """A sampling seed (0 to 2**31 - 1, within what every server takes) from ``parts``."""
    digest = hashlib.blake2b(b"\x00".join(parts), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def agent_seed(seed: int, index: int) -> int:
    """The seed of agent ``index`` of a rollout seeded ``seed`` (``POST /rollouts`` ``seed``)."""
    return _seed_of(b"agent", str(seed).encode(), str(index).encode())


def call_seed(seed: int, prompt_ids: Sequence[int]) -> int:
    """The seed of a call with ``prompt_ids`` in a session seeded ``seed``: from the prompt, not
    the call's place, so calls an agent makes at once get the same seeds in every run whatever
    order they reach the policy in (the same prompt twice in a session: the same seed)."""
    ids = array("q", prompt_ids).tobytes()
    return _seed_of(b"call", str(seed).encode(), ids)


def parse_limits(value: Any) -> Limits:
    """``{"max_calls", "max_tokens", "deadline_s"}`` (each optional) as ``Limits``; a
    ``ValueError`` worded for the caller otherwise."""
    if value is None:
        return Limits()
    if not isinstance(value, dict):
        raise ValueError('"limits" must be an object: {"max_calls", "max_tokens", "deadline_s"}')
    reject_unknown(value, SESSION_LIMIT_KEYS, "limit")
    out: dict[str, Any] = {}
    for name in ("max_calls", "max_tokens"):
        v = value.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f'"limits.{name}" must be a whole number of at least 1, not {v!r}')
        out[name] = v
    deadline = value.get("deadline_s")
    if deadline is not None:
        if (
            isinstance(deadline, bool)
            or not isinstance(deadline, int | float)
            or not math.isfinite(deadline)
            or deadline <= 0
        ):
            raise ValueError(
                f'"limits.deadline_s" must be a number of seconds > 0, not {deadline!r}'
            )
        out["deadline_s"] = float(deadline)
    return Limits(**out)


def check_session_id(value: Any) -> str:
    if not isinstance(value, str) or not SESSION_ID.fullmatch(value):
        raise ValueError(
            f'"id" must be 1 to 128 letters, digits, "_", "." or "-", starting with a letter or '
            f"digit; got {value!r}"
        )
    return value


def kept_apart_id(session_id: str) -> str:
    """The name the rows of calls made under ``session_id`` before it was opened are written
    under (``ID~unopened-HEX``): unique, and never an id a trainer can open."""
    return f"{session_id}{KEPT_APART}{secrets.token_hex(4)}"


def check_metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            '"metadata" must be a JSON object, e.g. {"task_id": "t1", "split": "train"}'
        )
    split = value.get("split")
    if split is not None and split not in SPLITS:
        raise ValueError(f'"metadata.split" must be one of {", ".join(SPLITS)}, not {split!r}')
    return dict(value)


@dataclass
class SessionMetrics:
    """What a session's calls did; returned at close and stored with its rows (``metrics``)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Seconds the policy spent on the session's calls (each call's latency, summed).
    policy_time_s: float = 0.0
    # Seconds from the session's opening (or first call) to its close.
    wall_time_s: float = 0.0
    # Calls the policy failed (journaled in failed/), and calls refused by a limit.
    errors: int = 0
    refused: int = 0
    # Calls that resent a request already answered (an SDK retry, a user's resend).
    retries: int = 0
    # Weight updates the policy had between the session's first call and its close (or now,
    # while it is open): how far behind the trainer's weights its oldest tokens are. 0: none.
    version_lag: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ControlledSession:
    id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    # Opened through the API (else: first seen on a call).
    opened: bool = False
    opened_at: float = field(default_factory=time.time)
    opened_mono: float = field(default_factory=time.monotonic)
    metrics: SessionMetrics = field(default_factory=SessionMetrics)
    # The first limit the session reached; None while none has.
    limit_reached: str | None = None
    closed: bool = False
    end_reason: str | None = None
    # Calls in flight now.
    in_flight: int = 0
    # Unix time of the session's last call start or end (the viewer's "last activity").
    last_active_at: float = field(default_factory=time.time)
    # Once closed: the thread shards holding its rows (GET /sessions/{id} reads them back).
    thread_shards: list[Any] = field(default_factory=list)
    # Minted when opened through the API: every call of the session must carry it (the proxy
    # password, or the API key in base-URL mode). Never in a summary, a log or a row.
    secret: str = field(default="", repr=False)
    # The weight version index (WeightHistory.index) when its first call came; None: none yet.
    first_version_index: int | None = None
    # Unix time of its opening, where that opening took the id from calls made before it (see
    # the module docstring): a call that started by then is not the session's. None: it did not.
    claimed_at: float | None = None
    # Calls the store did not record (begun before the opening): not counted at note_recorded.
    dropped: int = 0
    # How it was closed: "runner" (a rollout's runner) or "api" (POST /sessions/ID/close, by
    # whoever holds the token), with the reward given; late rewards given since (POST .../reward).
    closed_by: str | None = None
    close_reward: Any = None
    late_rewards: int = 0
    # Its calls' sampling is seeded from this (call_seed) where the call names no seed of its
    # own; None: the policy's own randomness.
    seed: int | None = None

    def past_deadline(self, now_mono: float) -> bool:
        """Whether ``limits.deadline_s`` has passed at ``now_mono`` (a monotonic clock's time):
        the one rule both the refusal of a call and the stop of a rollout's agent read."""
        deadline = self.limits.deadline_s
        return deadline is not None and now_mono - self.opened_mono >= deadline

    def summary(self) -> dict[str, Any]:
        seeded = {} if self.seed is None else {"seed": self.seed}
        return {
            "id": self.id,
            "opened": self.opened,
            "opened_at": self.opened_at,
            "metadata": self.metadata,
            "limits": {k: v for k, v in asdict(self.limits).items() if v is not None},
            "limit_reached": self.limit_reached,
            "closed": self.closed,
            "end_reason": self.end_reason,
            "in_flight": self.in_flight,
            "last_active_at": self.last_active_at,
            "metrics": self.metrics.as_dict(),
            **seeded,
        }


class SessionControl:
    """Every session's metadata, limits and metrics, live and recently closed."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._live: dict[str, ControlledSession] = {}
        self._closed: OrderedDict[str, ControlledSession] = OrderedDict()
        # Sessions nobody opened, no longer live (idle, written): their summary and metrics,
        # until a new call of theirs makes them live again.
        self._past: OrderedDict[str, ControlledSession] = OrderedDict()
        # Called once per session this process starts to know (opened, or first called).
        self.on_new: Any = None
        # Called at every open with (id, kept_apart_id): what the store holds of the id from
        # before goes under the new name (the gateway's SessionStore.detach).
        self.on_claim: Any = None
        # Staleness: weight updates a session may fall behind (None: any), and how many
        # updates the policy has had (capture/policy/weights.py WeightHistory.index).
        self.max_staleness: int | None = None
        self.version_index: Any = lambda: 0

    def _new(self, session_id: str) -> ControlledSession:
        sess = ControlledSession(session_id, opened_at=time.time(), opened_mono=self._clock())
        if self.on_new is not None:
            self.on_new(session_id)
        return sess

    # -- the trainer's side ----------------------------------------------------------------
    def open(
        self, session_id: str, metadata: dict[str, Any] | None = None, limits: Limits | None = None
    ) -> ControlledSession:
        """Open ``session_id``, empty. A session already open through the API is a ValueError
        (a trainer reusing an id by mistake). One only seen on calls so far (a proxy username,
        a base URL named before the trainer opened it: maybe an agent planting rows in a
        session it guessed) is not continued: its calls, metrics and rows go on under
        ``kept_apart_id`` (``on_claim``), never with this session's metadata or reward."""
        existing = self._live.get(session_id)
        if existing is not None and existing.opened:
            raise ValueError(f"session {session_id!r} is open already; close it first")
        # Reopening a closed id starts a new session under that name.
        self._closed.pop(session_id, None)
        earlier = self._live.pop(session_id, None) or self._past.pop(session_id, None)
        apart = kept_apart_id(session_id)
        sess = self._new(session_id)
        if earlier is not None:
            earlier.id = apart
            self._past[apart] = earlier
            while len(self._past) > PAST_KEPT:
                self._past.popitem(last=False)
            # Its calls still running end as this one's (call_finished): counted in flight, so
            # a limit never lets more through, until they end. They are not recorded.
            sess.in_flight = earlier.in_flight
        sess.metadata = dict(metadata or {})
        sess.limits = limits or Limits()
        sess.opened = True
        sess.secret = secrets.token_urlsafe(24)
        sess.opened_at = time.time()
        sess.opened_mono = self._clock()
        if earlier is not None:
            sess.claimed_at = sess.opened_at
        self._live[session_id] = sess
        if self.on_claim is not None:
            self.on_claim(session_id, apart)
        return sess

    def claimed_at(self, session_id: str) -> float | None:
        """When ``session_id`` was opened over calls made before (None: it was not): a call of
        it that started by then is not recorded (SessionStore.record)."""
        sess = self._live.get(session_id) or self._closed.get(session_id)
        return sess.claimed_at if sess is not None and sess.opened else None

    def note_dropped(self, session_id: str) -> None:
        """The store did not record a call of ``session_id`` (it began before the opening)."""
        sess = self._live.get(session_id)
        if sess is not None:
            sess.dropped += 1

    def get(self, session_id: str) -> ControlledSession | None:
        return (
            self._live.get(session_id) or self._closed.get(session_id) or self._past.get(session_id)
        )

    def credential_refusal(
        self, session_id: str, given: list[str], required: bool = False
    ) -> str | None:
        """Why a call naming ``session_id`` and carrying the secrets ``given`` must be refused,
        or None. A session opened through the API (live or closed) wants its own secret; one
        never opened is open to any caller unless ``required`` (agenttap_require_session_secret):
        once opened, it is not (see ``open``). Touches nothing: a refused caller cannot count
        against the session's limits."""
        sess = self.get(session_id)  # a past one was never opened: it has no secret
        if sess is None or not sess.secret:
            if required:
                return (
                    f"agenttap: session {session_id!r} was not opened through the control API; "
                    f"this proxy serves only opened sessions (agenttap_require_session_secret). "
                    f"Open one with POST /sessions and use the env or base_urls it returns."
                )
            return None
        expected = sess.secret.encode()
        if any(secrets.compare_digest(g.encode(), expected) for g in given if g):
            return None
        return (
            f"agenttap: session {session_id!r} wants its secret: use the env (HTTPS_PROXY="
            f"http://ID:SECRET@...) or the API key that POST /sessions returned for it."
        )

    def live(self) -> list[ControlledSession]:
        return list(self._live.values())

    def is_live(self, session_id: str) -> bool:
        return session_id in self._live

    def close(
        self,
        session_id: str,
        end_reason: str | None = None,
        closed_by: str = "api",
        reward: Any = None,
    ) -> ControlledSession:
        """Mark ``session_id`` closed (KeyError if it is not live); its end reason is
        ``end_reason`` if given, else the limit it reached, else ``stop``. ``closed_by`` and
        ``reward``: who closed it with what (a rollout's runner checks it was itself)."""
        sess = self._live.pop(session_id)
        sess.closed = True
        sess.closed_by = closed_by
        sess.close_reward = reward
        sess.end_reason = end_reason or sess.limit_reached or EndReason.STOP
        sess.metrics.wall_time_s = round(self._clock() - sess.opened_mono, 6)
        self._note_lag(sess)
        self._closed[session_id] = sess
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)
        return sess

    # -- the pipeline's side -----------------------------------------------------------------
    def _seen(self, session_id: str) -> ControlledSession:
        sess = self._live.get(session_id)
        if sess is None:
            sess = self._past.pop(session_id, None) or self._new(session_id)
            self._live[session_id] = sess
        return sess

    def refusal(self, session_id: str) -> str | None:
        """Why the next call of ``session_id`` must not reach the policy (an END_* reason), or
        None. A refused call is counted; the limit reached is remembered for the rows."""
        closed = self._closed.get(session_id)
        if closed is not None and session_id not in self._live:
            closed.metrics.refused += 1
            return EndReason.CLOSED
        sess = self._seen(session_id)
        if sess.first_version_index is None:
            sess.first_version_index = self.version_index()
        reason = self._reached(sess)
        if reason is not None:
            sess.limit_reached = sess.limit_reached or reason
            sess.metrics.refused += 1
        return reason

    def _reached(self, sess: ControlledSession) -> str | None:
        limits, metrics = sess.limits, sess.metrics
        if sess.past_deadline(self._clock()):
            return EndReason.DEADLINE
        # Calls in flight count: a burst of parallel calls cannot overrun the limit.
        if limits.max_calls is not None and metrics.calls + sess.in_flight >= limits.max_calls:
            return EndReason.MAX_CALLS
        if limits.max_tokens is not None and metrics.completion_tokens >= limits.max_tokens:
            return EndReason.MAX_TOKENS
        if (
            self.max_staleness is not None
            and sess.first_version_index is not None
            and self.version_index() - sess.first_version_index > self.max_staleness
        ):
            return EndReason.STALE
        return None

    def sampling_seed(self, session_id: str, prompt_ids: Sequence[int]) -> int | None:
        """The seed for a call of ``session_id`` with ``prompt_ids``; None: it is not seeded."""
        sess = self._live.get(session_id)
        if sess is None or sess.seed is None:
            return None
        return call_seed(sess.seed, prompt_ids)

    def tokens_left(self, session_id: str) -> int | None:
        """Sampled tokens the session may still use (None: no token limit)."""
        sess = self._live.get(session_id)
        if sess is None or sess.limits.max_tokens is None:
            return None
        return max(0, sess.limits.max_tokens - sess.metrics.completion_tokens)

    def call_started(self, session_id: str) -> None:
        sess = self._seen(session_id)
        sess.in_flight += 1
        sess.last_active_at = time.time()

    def call_finished(self, session_id: str) -> None:
        """A call ``call_started`` counted is over, whatever became of it."""
        sess = self._live.get(session_id)
        if sess is not None:
            sess.in_flight = max(0, sess.in_flight - 1)
            sess.last_active_at = time.time()
            # So far (a session nobody opened is never closed: this is its wall time).
            sess.metrics.wall_time_s = round(self._clock() - sess.opened_mono, 6)
            self._note_lag(sess)

    def _note_lag(self, sess: ControlledSession) -> None:
        if sess.first_version_index is not None:
            sess.metrics.version_lag = max(0, self.version_index() - sess.first_version_index)

    def note_recorded(
        self,
        session_id: str,
        prompt_tokens: int,
        completion_tokens: int,
        policy_time_s: float,
        retry: bool = False,
    ) -> None:
        """A call of ``session_id`` was answered by the policy and recorded."""
        sess = self._live.get(session_id)
        if sess is None:
            return  # closed meanwhile: its metrics were returned already
        if sess.dropped:  # a call begun before the opening: recorded nowhere, not its call
            sess.dropped -= 1
            return
        m = sess.metrics
        m.calls += 1
        m.prompt_tokens += prompt_tokens
        m.completion_tokens += completion_tokens
        m.policy_time_s = round(m.policy_time_s + policy_time_s, 6)
        m.retries += int(retry)

    def note_failure(self, session_id: str) -> None:
        """A call of ``session_id`` failed at the policy (journaled in failed/)."""
        sess = self._live.get(session_id)
        if sess is not None:
            sess.metrics.errors += 1

    def prune(self, keep: set[str]) -> None:
        """Move sessions nobody opened that are idle and no longer in ``keep`` (the store's
        live sessions) out of the live ones: still answered by ``get`` (the most recent
        ``PAST_KEPT``), no longer counted live; a new call makes one live again."""
        for sid in [
            s.id
            for s in self._live.values()
            if not s.opened and s.in_flight == 0 and s.id not in keep
        ]:
            self._past[sid] = self._live.pop(sid)
            self._past.move_to_end(sid)
        while len(self._past) > PAST_KEPT:
            self._past.popitem(last=False)
