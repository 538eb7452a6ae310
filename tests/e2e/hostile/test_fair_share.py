"""One agent cannot starve the rest (issue 47 item 6): a session sending 32 calls at once beside a
victim's one, through a real mitmdump and real HTTPS, answered by the scripted stub whose engine
holds every generation until the test lets it go (tests/support/stub_engine.py). Orders of
events are asserted, never times: how many of the hog's calls the policy runs at once
(``agenttap_session_max_inflight``), and that the victim's call starts at the policy before the
hog's calls that were queued when it came (its own queue; a saturated server's turns,
``agenttap_replica_max_inflight``). One proxy for both: a hog's bound (4) below the server's (5),
so that the bound is what holds the hog back, and two hogs saturate the server."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.hostile import Answer, good_body, post
from tests.support.paths import QWEN3
from tests.support.proxies import Proxy, proxy_token, start_proxy
from tests.support.stub_engine import StubEngine
from tests.support.stub_vllm import StubPolicy

HOG_CALLS = 32
SESSION_MAX = 4
SERVER_MAX = 5


@pytest.fixture(scope="module")
def policy() -> Iterator[StubPolicy]:
    stub = StubPolicy(str(QWEN3))
    stub.start()
    yield stub
    stub.stop()


@pytest.fixture(scope="module")
def proxy(
    policy: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    options = {
        "agenttap_session_max_inflight": str(SESSION_MAX),
        "agenttap_replica_max_inflight": str(SERVER_MAX),
    }
    extra = [arg for name, value in options.items() for arg in ("--set", f"{name}={value}")]
    started = start_proxy(policy.url, tmp_path_factory.mktemp("fair") / "out", confdir, extra=extra)
    started.token = proxy_token(started.log)
    yield started
    started.stop()


@pytest.fixture
def engine(policy: StubPolicy) -> Iterator[StubEngine]:
    """A held engine labelling each generation by the session word its prompt carries (HOGA,
    VICTIM: "hoga", "victim")."""

    def label(body: dict[str, Any]) -> str:
        found = re.search(r"\b(HOG\w*|VICTIM\w*)\b", str(policy.tok.decode(body["prompt"])))
        return found.group(1).lower() if found else "other"

    held = StubEngine(label=label)
    held.hold = True
    policy.engine = held
    yield held
    held.release_all()
    policy.engine = None


def sessions(proxy: Proxy) -> dict[str, dict[str, Any]]:
    """GET /sessions through the proxy (agenttap.local), by id."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{proxy.port}"})
    )
    req = urllib.request.Request(
        "http://agenttap.local/sessions", headers={"Authorization": f"Bearer {proxy.token}"}
    )
    with opener.open(req, timeout=30) as resp:
        return {s["id"]: s for s in json.load(resp)["sessions"]}


def wait_queued(proxy: Proxy, session: str, queued: int, timeout_s: float = 20) -> None:
    """Until agenttap says ``queued`` of the session's calls wait for the policy (polled: the
    queue lives in mitmdump, and its count is what an operator reads)."""
    deadline = time.monotonic() + timeout_s
    seen: Any = None
    while time.monotonic() < deadline:
        seen = sessions(proxy).get(session, {}).get("policy_queued")
        if seen == queued:
            return
        time.sleep(0.05)
    pytest.fail(f"{session}: {queued} calls never queued at agenttap (last seen {seen})")


def calls(proxy: Proxy, word: str, n: int) -> Callable[[], list[Answer]]:
    """Start ``n`` calls at once of the session ``word`` names (lower case), each prompt
    carrying ``word``; the returned function joins them."""
    answers: list[Answer] = []

    def one(i: int) -> None:
        body = json.dumps(good_body("openai.chat", f"{word} call {i}")).encode()
        answers.append(post(proxy, word.lower(), "openai.chat", body, timeout=60))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()

    def join() -> list[Answer]:
        for t in threads:
            t.join(60)
        return answers

    return join


def test_a_hog_runs_at_most_its_share_and_the_victim_goes_before_its_queue(
    proxy: Proxy, engine: StubEngine
) -> None:
    hog = calls(proxy, "HOG", HOG_CALLS)
    engine.wait_for(lambda e: e.running["hog"] == SESSION_MAX, "the hog's calls to run")
    wait_queued(proxy, "hog", HOG_CALLS - SESSION_MAX)
    victim = calls(proxy, "VICTIM", 1)
    engine.wait_for(lambda e: e.running["victim"] == 1, "the victim's call to run")
    # The server had room for one more of the hog's (SERVER_MAX), its own bound held it back;
    # the victim started while every started call of the hog's was held and the rest waited.
    assert engine.started == ["hog"] * SESSION_MAX + ["victim"]
    engine.release_all()
    victims, hogs = victim(), hog()
    assert [a.status for a in victims] == [200], victims[0].body[:300]
    assert sorted(a.status for a in hogs) == [200] * HOG_CALLS
    assert engine.peak["hog"] == SESSION_MAX and engine.started.count("hog") == HOG_CALLS


def test_a_saturated_server_serves_the_victim_before_the_hogs_queued_calls(
    proxy: Proxy, engine: StubEngine
) -> None:
    first = calls(proxy, "HOGA", HOG_CALLS)
    engine.wait_for(lambda e: e.running["hoga"] == SESSION_MAX, "the first hog's calls to run")
    wait_queued(proxy, "hoga", HOG_CALLS - SESSION_MAX)
    # The second hog takes the server's last slot; 3 of its calls wait at the server.
    second = calls(proxy, "HOGB", HOG_CALLS)
    engine.wait_for(lambda e: e.running["hogb"] == 1, "the second hog to fill the server")
    wait_queued(proxy, "hogb", HOG_CALLS - 1)
    victim = calls(proxy, "VICTIM2", 1)
    wait_queued(proxy, "victim2", 1)
    engine.release(1)  # one slot frees: the victim's turn, before the hogs' waiting calls
    engine.wait_for(lambda e: len(e.started) == SERVER_MAX + 1, "the next call to start")
    assert engine.started[-1] == "victim2", engine.started
    engine.release_all()
    answers = victim() + first() + second()
    assert sorted(a.status for a in answers) == [200] * (2 * HOG_CALLS + 1)
    assert engine.peak["hoga"] == SESSION_MAX and engine.peak["hogb"] <= SESSION_MAX
