"""Prometheus metrics of one agenttap instance, served at ``GET /metrics`` on the API listener.

Every name starts with ``agenttap_``. Each gateway has a registry of its own (two instances in
one process never share counters). Counted where the turn pipeline decides
(capture/pipeline/turn.py):
calls by provider and outcome, tokens in and out, latency and time to first token, errors by
kind; sessions and rollouts are read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a few milliseconds (a cached short answer) to a long agent step.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _Live(Collector):
    """Values read when scraped: live sessions, calls in flight, rollouts running, policies."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read

    def collect(self):  # type: ignore[no-untyped-def]
        values = self._read()
        helps = {
            "agenttap_sessions_live": "Sessions with unwritten calls, or opened and not closed.",
            "agenttap_calls_in_flight": "Model calls being answered now.",
            "agenttap_calls_queued": "Model calls waiting for their turn at the policy "
            "(agenttap_session_max_inflight, agenttap_replica_max_inflight).",
            "agenttap_rollout_agents_running": "Agents that rollouts run now.",
        }
        for name, help_text in helps.items():
            yield GaugeMetricFamily(name, help_text, value=values.get(name, 0.0))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter(
            "agenttap_calls", "Model calls by provider and outcome (ok, policy_error, refused, "
            "bad_request).", ["protocol", "outcome"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "agenttap_prompt_tokens", "Prompt tokens sent to the policy.", ["protocol"], registry=r
        )
        self.completion_tokens = Counter(
            "agenttap_completion_tokens", "Tokens the policy sampled.", ["protocol"], registry=r
        )
        self.latency = Histogram(
            "agenttap_call_latency_seconds", "Seconds from a call's arrival to its answer's end.",
            ["protocol"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.first_token = Histogram(
            "agenttap_time_to_first_token_seconds",
            "Seconds from a streamed call's arrival to its first token.",
            ["protocol"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "agenttap_errors", "Errors by kind (policy_unavailable, policy_failed, "
            "prompt_too_long, limit, bad_request).", ["kind"], registry=r,
        )  # fmt: skip
        self.sessions_opened = Counter(
            "agenttap_sessions_opened",
            "Sessions started: opened through the control API or first seen on a call.",
            registry=r,
        )
        self.sessions_closed = Counter(
            "agenttap_sessions_closed", "Sessions closed, by end reason.", ["end_reason"],
            registry=r,
        )  # fmt: skip
        self.policy_up = Gauge(
            "agenttap_policy_up", "1 when the policy server answered its last probe, else 0.",
            ["backend"], registry=r,
        )  # fmt: skip
        self.weights_changed = Counter(
            "agenttap_policy_weights_changed", "Policy servers found serving weights nobody "
            "pushed through agenttap (their fingerprint changed without an update).",
            ["backend"], registry=r,
        )  # fmt: skip
        self.weights_unverified = Gauge(
            "agenttap_policy_weights_unverified", "1 while the policy server is out of rotation "
            "because its weights are not verified (a failed probe, a changed fingerprint).",
            ["backend"], registry=r,
        )  # fmt: skip

    def watch(self, read: Callable[[], dict[str, float]]) -> None:
        self.registry.register(_Live(read))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
