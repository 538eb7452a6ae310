"""The trajectory viewer in a real browser (Debian's chromium, driven by playwright): offline over
a folder of shards with one command, and live at a running proxy's ``/ui/``. The checks read
what the page shows: sessions, the row tree, tokens marked by provenance and loss mask with the
logprob on hover, call boundaries, tool calls, a diff of two calls, a 100,000-token row; a row
opens at its first trained token, links lead back (row -> session -> list), hostile ids and text
show as text, and no request the page makes fails (its icon answers without the token)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from capture.storage.advantages import write_advantage
from tests.support.paths import QWEN3, REPO
from tests.support.stub_vllm import StubPolicy
from tests.support.viewer_data import (
    HOSTILE_REQUEST,
    HOSTILE_SESSION,
    HOSTILE_TEXT,
    REMINDER,
    TOOL_CALL,
    write_agent_session,
    write_hostile_session,
    write_long_prompt_session,
    write_long_session,
    write_run,
)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class Watch:
    """What a page's console and network said: errors (console errors, uncaught exceptions)
    and failed requests (a 4xx/5xx answer, or none)."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        self.failed: list[str] = []
        self.requests: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("request", lambda r: self.requests.append(r.url))
        page.on(
            "response",
            lambda r: self.failed.append(f"{r.status} {r.url}") if r.status >= 400 else None,
        )
        page.on("requestfailed", lambda r: self.failed.append(f"{r.failure} {r.url}"))

    def assert_clean(self) -> None:
        assert not self.failed and not self.errors, (self.failed, self.errors)


def in_view(page: Any, selector: str) -> bool:
    """The element is drawn inside the visible part of the scrolled pane."""
    return bool(
        page.evaluate(
            """(sel) => {
                const e = document.querySelector(sel), root = document.querySelector('#right');
                if (!e) return false;
                const r = e.getBoundingClientRect(), v = root.getBoundingClientRect();
                return r.bottom > v.top && r.top < v.bottom && r.height > 0;
            }""",
            selector,
        )
    )


def get(url: str, token: str = "") -> tuple[int, str, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: run scripts/setup.sh (it installs it with apt)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def serve(out: Path, *extra: str) -> Iterator[str]:
    """``python -m capture.viewer_http OUT ...``, as a user runs it: yields the URL it prints."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "capture.viewer_http", str(out), *extra, "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"agenttap viewer: (http://\S+/ui/)", line)
        assert match, f"no URL line from the viewer: {line!r}"
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory, tok: Any) -> Iterator[tuple[str, Path]]:
    """The offline viewer with a tokenizer over a few sessions of every kind."""
    out = tmp_path_factory.mktemp("viewer-out")
    write_agent_session(out, tok)
    write_long_session(out)
    write_long_prompt_session(out)
    write_hostile_session(out, tok)
    for url in serve(out, "--tokenizer", str(QWEN3)):
        yield url, out


def test_offline_sessions_tree_tokens_and_calls(browser: Any, offline: tuple[str, Path]) -> None:
    url, out = offline
    page = browser.new_page()
    watch = Watch(page)
    page.goto(url)
    page.wait_for_selector("tr.session[data-session='agent-1']")
    assert str(out.resolve()) in page.inner_text("#source")
    agent = page.locator("tr.session[data-session='agent-1']")
    text = agent.inner_text()
    assert "task_id=swe-42" in text and "4 rows (1 dead)" in text and "stop" in text
    assert agent.locator("td.reward").inner_text() == "1"
    agent.click()
    page.wait_for_selector("#tree .node")
    tree = page.inner_text("#tree")
    for word in (
        "t-req-1",
        "rewritten",
        "branch",
        "dead: superseded",
        "spawn",
        "spawned by call_abc",
    ):
        assert word in tree
    # The tree nests the children under their parent row.
    assert page.locator("#tree > ul > li").count() == 1
    assert page.locator("#tree > ul > li > ul > li").count() == 3
    # Calls: the tool call the client got, what it was told.
    first_call = page.locator("#calls tr[data-request='req-0']").inner_text()
    assert 'read_file({"path": "src/app.py"})' in first_call and "tool_calls" in first_call

    page.locator(".node[data-thread='t-req-1']").click()
    page.wait_for_selector("#tokens .page[data-page='0']:not(.unloaded)")
    tokens = page.inner_text("#tokens")
    assert "Fix the failing test" in tokens and "<tool_call>" in tokens
    assert "▶ call 0 req-0" in tokens and "■ call 1: stop" in tokens
    # Sampled tokens are trained (loss mask 1) and carry their logprob on hover and as colour.
    sampled = page.locator("#tokens .t.p1.m1").first
    title = sampled.get_attribute("title") or ""
    assert "sampled, trained" in title and re.search(r"logprob -\d", title)
    assert "rgba(229, 57, 53" in (sampled.get_attribute("style") or "")
    prompt = page.locator("#tokens .t.p0").first
    assert "not trained" in (prompt.get_attribute("title") or "")
    assert page.locator("#tokens .t.p0.m1").count() == 0
    assert "loss mask 1 on" in page.inner_text("#overview")

    # The row's page links back to its session, the session's page back to the list.
    assert page.locator("#session-view").is_hidden()
    back = page.locator("#back-to-session")
    assert back.is_visible() and "agent-1" in back.inner_text()
    back.click()
    page.wait_for_selector("#session-view", state="visible")
    assert page.locator("#row-view").is_hidden()
    assert page.evaluate("location.hash") == "#session=agent-1"
    assert page.locator("#tree .node[data-thread='t-req-1']").is_visible()
    page.locator("#back-to-list").click()
    page.wait_for_selector("#run-view", state="visible")
    assert page.locator("#session-view").is_hidden() and page.locator("#row-view").is_hidden()
    assert page.locator("tr.session.selected").count() == 0
    # Browser history goes the same way back: the session, then the row.
    page.go_back()
    page.wait_for_selector("#session-view", state="visible")
    page.go_back()
    page.wait_for_selector("#tokens .t.m1")
    assert page.locator("#row-view").is_visible()
    # The page declares its icon, which answers without a token: no request failed (a 401 or
    # 404 for /favicon.ico shows in the console), nothing logged an error.
    icon = page.evaluate("document.querySelector('link[rel=icon]').href")
    assert icon == url + "favicon.ico"
    status, kind, body = get(icon)
    assert status == 200 and kind == "image/x-icon" and body[:4] == b"\x00\x00\x01\x00"
    watch.assert_clean()
    page.close()


def test_a_row_opens_at_its_first_trained_token(browser: Any, offline: tuple[str, Path]) -> None:
    url, _ = offline
    page = browser.new_page()
    watch = Watch(page)
    page.goto(url)
    page.locator("tr.session[data-session='prompt-1']").click()
    page.locator(".node[data-thread='t-lp-0']").click()
    # 12,000 prompt tokens, then the sampled ones: the row opens at token 12,000, not at 0.
    first = "#tokens .t[data-i='12000']"
    page.wait_for_selector(first)
    assert "from token 12000" in page.inner_text("#row-meta")
    assert "trained" in (page.locator(first).get_attribute("title") or "")
    assert page.locator(first).get_attribute("class") == "t p1 m1"
    assert page.evaluate("document.querySelector('#right').scrollTop") > 0
    assert in_view(page, first)
    assert not in_view(page, "#tokens .page[data-page='0']")
    # The pages around it load as they come near the view; the first trained token stays put.
    page.wait_for_selector("#tokens .page[data-page='5']:not(.unloaded)")
    page.wait_for_timeout(300)
    assert in_view(page, first)
    assert page.locator("#tokens .page[data-page='0'].unloaded").count() == 1
    assert "loss mask 1 on 300 of 12300" in page.inner_text("#overview")
    # The address names the row: a reload opens it there again.
    page.reload()
    page.wait_for_selector(first)
    assert in_view(page, first) and page.locator("#row-view").is_visible()
    watch.assert_clean()
    page.close()


def test_hostile_ids_and_text_show_as_text(browser: Any, offline: tuple[str, Path]) -> None:
    url, _ = offline
    page = browser.new_page()
    watch = Watch(page)
    page.goto(url)
    row = page.locator("tr.session").filter(has_text="evil&row=x#")
    row.wait_for()
    assert HOSTILE_SESSION in row.inner_text()
    row.click()
    node = page.locator("#tree .node")
    node.wait_for()
    assert "t-" + HOSTILE_REQUEST in node.inner_text()
    node.click()
    page.wait_for_selector("#tokens .t.m1")
    assert page.inner_text("#row-id") == "t-" + HOSTILE_REQUEST
    assert HOSTILE_TEXT in page.inner_text("#tokens")
    assert HOSTILE_SESSION in page.inner_text("#back-to-session")
    page.locator("#back-to-session").click()
    page.wait_for_selector("#session-view", state="visible")
    assert page.inner_text("#session-id") == HOSTILE_SESSION
    # Nothing of it became markup: no image, no script ran.
    assert page.locator("#right img, #left img, #right script").count() == 0
    assert page.evaluate("window.__pwned") is None
    watch.assert_clean()
    page.close()


def test_offline_diff_of_two_calls_shows_the_rewrite(
    browser: Any, offline: tuple[str, Path]
) -> None:
    url, _ = offline
    page = browser.new_page()
    page.goto(url)
    page.locator("tr.session[data-session='agent-1']").click()
    page.wait_for_selector("#calls tr[data-request='req-2']")
    assert page.locator("#diff-button").is_disabled()
    page.locator("#calls tr[data-request='req-1'] input[name='diff-a']").check()
    page.locator("#calls tr[data-request='req-2'] input[name='diff-b']").check()
    page.locator("#diff-button").click()
    page.wait_for_selector("#diff .d-insert")
    inserted = " ".join(page.locator("#diff .d-insert").all_inner_texts())
    assert REMINDER in inserted and "Thanks" in inserted
    assert "kept" in page.inner_text("#diff-summary")
    # An exact extension says so.
    page.locator("#calls tr[data-request='req-0'] input[name='diff-a']").check()
    page.locator("#calls tr[data-request='req-1'] input[name='diff-b']").check()
    page.locator("#diff-button").click()
    page.wait_for_function(
        "document.querySelector('#diff-summary').textContent.includes('nothing was rewritten')"
    )
    assert "<tool_response>" in " ".join(page.locator("#diff .d-insert").all_inner_texts())
    page.close()


def test_a_100k_token_row_opens_a_page_at_a_time(browser: Any, offline: tuple[str, Path]) -> None:
    url, _ = offline
    page = browser.new_page()
    page.goto(url)
    page.locator("tr.session[data-session='long-1']").click()
    page.locator(".node[data-thread='t-long-2']").click()
    # It opens at its first trained token (the first call's sampled ones), on page 16.
    page.wait_for_selector("#tokens .t[data-i='32833']")
    assert in_view(page, "#tokens .t[data-i='32833']")
    assert "100000 tokens" in page.inner_text("#row-meta")
    # Only the pages in view are drawn: the page is not holding 100,000 spans.
    drawn = page.locator("#tokens .t").count()
    assert 2000 <= drawn <= 8000, drawn
    assert page.locator("#tokens .page").count() == 50
    # The page still answers at once while the row is open.
    assert page.evaluate("1 + 1") == 2
    # Jumping to the last call draws its page, with its boundary and its last token.
    page.locator("#row-calls a", has_text="long-2").click()
    page.wait_for_selector("#tokens .t[data-i='99999']")
    assert page.locator("#call-2").is_visible()
    assert page.locator("#tokens .t").count() < 20_000
    page.close()


def test_live_proxy_viewer_shows_live_sessions_and_wants_the_token(
    browser: Any, stub_tap: AgentTap, stub: StubPolicy
) -> None:
    import openai

    sess = stub_tap.open_session(metadata={"task_id": "live-task"})
    client = openai.OpenAI(
        base_url=sess.base_urls["openai"], api_key=sess.api_key, max_retries=0, timeout=60
    )
    stub.replies.clear()
    stub.script(TOOL_CALL)
    client.chat.completions.create(
        model="gpt-5",
        messages=[{"role": "user", "content": "read it"}],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "read_file",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
                },
            }
        ],
    )
    # The page and its icon hold no data and answer without the token; the data wants it.
    status, kind, body = get(f"{stub_tap.api_url}/ui/favicon.ico")
    assert status == 200 and kind == "image/x-icon" and body[:4] == b"\x00\x00\x01\x00"
    assert get(f"{stub_tap.api_url}/ui/")[0] == 200
    assert get(f"{stub_tap.api_url}/ui/api/sessions")[0] == 401
    assert get(f"{stub_tap.api_url}/ui/api/sessions", stub_tap.token)[0] == 200
    page = browser.new_page()
    # Without the token the page says where to find it.
    page.goto(f"{stub_tap.api_url}/ui/")
    page.wait_for_function("document.querySelector('#error').textContent.length > 0")
    assert "AGENTTAP_TOKEN" in page.inner_text("#error")
    page.goto(f"{stub_tap.api_url}/ui/#token={stub_tap.token}")
    page.reload()
    row = page.locator(f"tr.session[data-session='{sess.id}']")
    row.wait_for()
    assert row.locator(".badge.live").count() == 1 and "task_id=live-task" in row.inner_text()
    row.click()
    page.wait_for_selector("#tree .node")
    assert "not written yet" in page.inner_text("#tree")
    meta = page.inner_text("#session-meta")
    assert "live: 1 calls" in meta and stub.url.rstrip("/") in meta
    calls = page.locator("#calls tbody tr")
    assert calls.count() == 1 and "read_file" in calls.inner_text()
    page.locator("#tree .node").first.click()
    page.wait_for_selector("#tokens .page[data-page='0']:not(.unloaded)")
    assert "<tool_call>" in page.inner_text("#tokens")
    # The token is kept for the tab and taken out of the address.
    assert "token" not in page.url and stub_tap.token not in page.url
    # Closed, the session's rows come from its shards, with the reward.
    # Flushed but still open: its rows are in the shards, and it is still live.
    stub_tap.flush(sess.id)
    page.reload()
    row = page.locator(f"tr.session[data-session='{sess.id}']")
    row.wait_for()
    assert row.locator(".badge.live").count() == 1
    row.click()
    page.wait_for_selector("#tree .node")
    assert "not written yet" not in page.inner_text("#tree")
    sess.close(reward=3.0)
    page.reload()
    row = page.locator(f"tr.session[data-session='{sess.id}']")
    row.wait_for()
    assert row.locator(".badge.live").count() == 0 and row.locator("td.reward").inner_text() == "3"
    page.close()
    # Opened with the token, the page's every request answers (its icon, without the token).
    page = browser.new_page()
    watch = Watch(page)
    page.goto(f"{stub_tap.api_url}/ui/#token={stub_tap.token}")
    page.locator(f"tr.session[data-session='{sess.id}']").click()
    page.locator("#tree .node").first.click()
    page.wait_for_selector("#tokens .t.m1")
    page.locator("#back-to-session").click()
    page.wait_for_selector("#session-view", state="visible")
    watch.assert_clean()
    page.close()


def test_a_live_runs_page_moves_on_without_a_reload(
    browser: Any, stub_tap: AgentTap, stub: StubPolicy
) -> None:
    """On a running proxy the run view is read again every few seconds (``?refresh_s=1``
    here): a group that closes after the page opened appears in it, the page never reloaded."""
    import openai

    page = browser.new_page()
    watch = Watch(page)
    page.goto(f"{stub_tap.api_url}/ui/?refresh_s=1#token={stub_tap.token}")
    page.wait_for_selector("#run-view", state="visible")
    assert "live: refreshed every 1 s" in page.inner_text("#source")
    page.evaluate("window.notReloaded = true")
    assert page.locator("#groups tr.group[data-group='live-group']").count() == 0
    sess = stub_tap.open_session(metadata={"trainer_step": 9001, "group_id": "live-group"})
    client = openai.OpenAI(
        base_url=sess.base_urls["openai"], api_key=sess.api_key, max_retries=0, timeout=60
    )
    stub.replies.clear()
    stub.script("Hello.")
    client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    sess.close(reward=0.5)
    row = page.locator("#groups tr.group[data-group='live-group']")
    row.wait_for(timeout=20_000)
    assert "9001" in row.inner_text() and page.evaluate("window.notReloaded") is True
    assert int(page.evaluate("document.body.dataset.refreshes")) >= 1
    watch.assert_clean()
    page.close()


# -- a run: 504 sessions in 36 GRPO groups over 12 trainer steps --------------------------------
STEPS, GROUPS_PER_STEP, GROUP_SIZE = 12, 3, 14


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, list[dict[str, Any]], Path]]:
    """The offline viewer (no tokenizer) over a run's shards, plus one long row without a step;
    yields its URL, the sessions written, and a folder for screenshots."""
    out = tmp_path_factory.mktemp("viewer-run")
    truth = write_run(out, STEPS, GROUPS_PER_STEP, GROUP_SIZE)
    write_long_session(out)
    # One group's advantages as its trainer used them (TRL's scale_rewards="group"), sent by
    # the adapter (POST /sessions/ID/advantage writes this file), with the trainer's own time
    # for their step.
    members = [s for s in truth if s["group"] == TRAINER_GROUP]
    advantages = grpo_group_advantages([s["reward"] for s in members])
    for s, advantage in zip(members, advantages, strict=True):
        write_advantage(out, s["id"], advantage, s["step"], TRAINER_STEP_S)
    shots = tmp_path_factory.mktemp("viewer-screenshots")
    for url in serve(out):
        yield url, truth, shots


# The group whose trainer sent its own advantages (the others show the page's estimate), and
# the trainer's time for its step (6) it sent with them.
TRAINER_GROUP = "grpo-06-2"
TRAINER_STEP_S = 123.25


def grpo_group_advantages(rewards: list[float]) -> list[float]:
    """TRL's GRPO advantages with ``scale_rewards="group"``: the reward less the group's mean,
    over the group's (unbiased) standard deviation plus 1e-4."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5
    return [(r - mean) / (std + 1e-4) for r in rewards]


def screenshot(page: Any, shots: Path, name: str) -> None:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path))
    assert path.stat().st_size > 10_000
    print(f"screenshot: {path}")


def by_step(truth: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for s in truth:
        out.setdefault(s["step"], []).append(s)
    return out


def number(text: str) -> float:
    return float(text.replace("+", "").replace("−", "-"))


def test_the_run_view_plots_a_point_per_step(browser: Any, run: Any) -> None:
    url, truth, shots = run
    assert len(truth) >= 500 and len({s["group"] for s in truth}) >= 20
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    watch = Watch(page)
    page.goto(url)
    page.wait_for_selector("svg[data-plot='reward'] g.step")
    summary = page.inner_text("#run-summary")
    assert "505 sessions, 12 trainer_step values, 36 groups" in summary
    assert "1 session without trainer_step" in summary
    for name in ("reward", "status", "tokens", "time"):
        assert page.locator(f"svg[data-plot='{name}'] g.step").count() == STEPS, name
    steps = by_step(truth)
    # The reward's mean per step, its spread band and min-max whisker; the numbers on hover.
    means = page.eval_on_selector_all(
        "svg[data-plot='reward'] circle.pt", "els => els.map(e => Number(e.dataset.value))"
    )
    assert len(means) == STEPS
    for step, mean in enumerate(means):
        rewards = [s["reward"] for s in steps[step]]
        assert mean == pytest.approx(sum(rewards) / len(rewards), abs=1e-9)
    assert page.locator("svg[data-plot='reward'] polygon.band").count() == 1
    assert page.locator("svg[data-plot='reward'] line.whisker").count() == STEPS
    hover = page.locator("svg[data-plot='reward'] g.step[data-step='11'] title").text_content()
    assert hover is not None and "42 of 42 sessions rewarded" in hover and "±" in hover
    # Sessions per status, stacked: each step's bars add up to its sessions.
    for step in range(STEPS):
        values = page.eval_on_selector_all(
            f"svg[data-plot='status'] g.step[data-step='{step}'] rect.bar",
            "els => els.map(e => [e.dataset.series, Number(e.dataset.value)])",
        )
        want: dict[str, int] = {}
        for s in steps[step]:
            want[s["status"]] = want.get(s["status"], 0) + 1
        assert dict(values) == want
    # Tokens (all, trained) and time per step: the trainer's own for step 6 (it sent it with
    # TRAINER_GROUP's advantages), first call's start to last call's end elsewhere.
    tokens = page.eval_on_selector_all(
        "svg[data-plot='tokens'] rect.bar[data-series='all']",
        "els => els.map(e => Number(e.dataset.value))",
    )
    assert tokens == [sum(s["tokens"] for s in steps[k]) for k in range(STEPS)]
    trained = page.eval_on_selector_all(
        "svg[data-plot='tokens'] rect.bar[data-series='trained']",
        "els => els.map(e => Number(e.dataset.value))",
    )
    assert trained == [sum(s["trained"] for s in steps[k]) for k in range(STEPS)]
    times = page.eval_on_selector_all(
        "svg[data-plot='time'] rect.bar", "els => els.map(e => Number(e.dataset.value))"
    )
    assert len(times) == STEPS
    for k, t in enumerate(times):
        span = max(s["ended_at"] for s in steps[k]) - min(s["started_at"] for s in steps[k])
        assert t == pytest.approx(TRAINER_STEP_S if k == 6 else span, abs=1e-6), k
    assert page.text_content("svg[data-plot='time'] text.plot-title") == (
        "time per step (the trainer's where it sent it, else first call to last, s)"
    )
    # The groups, newest step first.
    assert page.locator("#groups tr.group").count() == STEPS * GROUPS_PER_STEP
    assert page.locator("#groups tr.group").first.locator("td").nth(1).inner_text() == "11"
    screenshot(page, shots, "run")
    # Per weight version: the sessions whose weights moved count under the newer one.
    page.select_option("#run-by", "version")
    page.wait_for_function(
        "document.querySelectorAll(\"svg[data-plot='reward'] g.step\").length === 13"
    )
    labels = page.eval_on_selector_all(
        "svg[data-plot='reward'] g.step", "els => els.map(e => e.dataset.step)"
    )
    assert labels == [f"v{k}" for k in range(STEPS + 1)]
    # Clicking a step lists its sessions.
    page.select_option("#run-by", "trainer_step")
    page.wait_for_selector("svg[data-plot='reward'] g.step[data-step='3']")
    page.locator("svg[data-plot='reward'] g.step[data-step='3'] rect.hit").click(force=True)
    page.wait_for_selector("#filters .chip[data-key='trainer_step']")
    page.wait_for_function("document.querySelector('#list-count').textContent.includes('42 of')")
    watch.assert_clean()
    page.close()


def test_a_group_shows_its_rollouts_rewards_and_advantages(browser: Any, run: Any) -> None:
    url, truth, shots = run
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    watch = Watch(page)
    page.goto(url)
    page.locator("#groups tr.group[data-group='grpo-05-1']").click()
    page.wait_for_selector("#group-view tr.rollout")
    members = sorted((s for s in truth if s["group"] == "grpo-05-1"), key=lambda s: s["index"])
    mean = sum(s["reward"] for s in members) / len(members)
    rows = page.locator("#group-rollouts tr.rollout")
    assert rows.count() == GROUP_SIZE
    advantages = []
    for k, s in enumerate(members):
        row = rows.nth(k)
        assert row.get_attribute("data-session") == s["id"]
        reward = number(row.locator("td.reward").inner_text())
        advantage = number(row.locator("td.advantage").inner_text() or "0")
        # Shown to 3 significant digits.
        assert reward == pytest.approx(s["reward"], rel=5e-3, abs=1e-3)
        assert advantage == pytest.approx(s["reward"] - mean, rel=5e-3, abs=1e-3)
        advantages.append(advantage)
        assert s["status"] in row.inner_text()
    assert sum(advantages) == pytest.approx(0, abs=0.02)
    assert "trainer_step 5" in page.inner_text("#group-meta")
    # No trainer sent this group's: the page says its own is an estimate.
    assert page.inner_text("#advantage-head") == "advantage (estimate)"
    assert "an estimate, reward − group mean" in page.inner_text("#group-meta")
    assert page.locator("svg[data-plot='group'] g.step").count() == GROUP_SIZE
    assert page.locator("svg[data-plot='group'] line.hline").count() == 1
    screenshot(page, shots, "group")
    # Each rollout opens its rows.
    rows.nth(4).locator("a.row-link").click()
    page.wait_for_selector("#row-view", state="visible")
    assert page.inner_text("#row-id") == "t-grpo-05-1-4"
    watch.assert_clean()
    page.close()


def test_another_run_is_drawn_over_this_one(
    browser: Any, run: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``?compare=OUT2``: another run's reward mean, trained tokens and time per step, drawn
    over this run's on one axis (its steps this run lacks too); a folder that holds no run is
    refused with what to give."""
    url, truth, shots = run
    other_out = tmp_path_factory.mktemp("viewer-other-run")
    other = write_run(other_out, STEPS + 2, 2, 4, seed=11)
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    watch = Watch(page)
    base = url.split("#")[0]
    page.goto(base + "?compare=" + urllib.parse.quote(str(other_out)))
    page.wait_for_selector("svg[data-plot='reward'] circle.pt")
    assert page.inner_text("#run-summary").startswith(f"Compared with {other_out.resolve()}")
    name = other_out.name
    mine = page.eval_on_selector_all(
        "svg[data-plot='reward'] circle.pt[data-series='reward, this run']",
        "els => els.map(e => Number(e.dataset.value))",
    )
    theirs = page.eval_on_selector_all(
        f"svg[data-plot='reward'] circle.pt[data-series='reward, {name}']",
        "els => els.map(e => [e.parentNode.dataset.step, Number(e.dataset.value)])",
    )
    assert len(mine) == STEPS and len(theirs) == STEPS + 2
    for step, mean in theirs:
        rewards = [s["reward"] for s in other if s["step"] == int(step)]
        assert mean == pytest.approx(sum(rewards) / len(rewards), abs=1e-9)
    trained = page.eval_on_selector_all(
        f"svg[data-plot='tokens'] rect.bar[data-series='trained, {name}']",
        "els => els.map(e => Number(e.dataset.value))",
    )
    assert trained == [sum(s["trained"] for s in other if s["step"] == k) for k in range(STEPS + 2)]
    assert page.locator(f"svg[data-plot='time'] rect.bar[data-series='time, {name}']").count()
    screenshot(page, shots, "compare")
    watch.assert_clean()
    page.close()
    # A folder that is not a run's: the reason, and the run view is not drawn over it.
    page = browser.new_page()
    page.goto(base + "?compare=" + urllib.parse.quote(str(other_out / "threads" / "x")))
    page.wait_for_function("document.querySelector('#error').textContent.length > 0")
    assert "not an agenttap output folder" in page.inner_text("#error")
    page.close()


def test_a_group_shows_the_trainers_own_advantages_where_it_sent_them(
    browser: Any, run: Any
) -> None:
    """A group whose trainer sent its advantages (scaled by the group's spread, as TRL's
    ``scale_rewards="group"`` does) shows those, labelled as the trainer's; the page's own
    estimate (reward less the mean) would differ by the spread's factor."""
    url, truth, _ = run
    members = sorted((s for s in truth if s["group"] == TRAINER_GROUP), key=lambda s: s["index"])
    rewards = [s["reward"] for s in members]
    trainer = grpo_group_advantages(rewards)
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    watch = Watch(page)
    page.goto(url.split("#")[0] + "#group=" + TRAINER_GROUP)
    page.wait_for_selector("#group-view tr.rollout")
    assert page.inner_text("#advantage-head") == "advantage (trainer)"
    assert "the trainer's own" in page.inner_text("#group-meta")
    rows = page.locator("#group-rollouts tr.rollout")
    assert rows.count() == len(members)
    mean = sum(rewards) / len(rewards)
    for k, s in enumerate(members):
        cell = rows.nth(k).locator("td.advantage")
        assert cell.get_attribute("data-source") == "trainer"
        shown = number(cell.inner_text())
        assert shown == pytest.approx(trainer[k], rel=5e-3, abs=1e-3)
        if abs(s["reward"] - mean) > 0.05:  # the estimate is another number
            assert shown != pytest.approx(s["reward"] - mean, rel=5e-3, abs=1e-3)
    watch.assert_clean()
    page.close()


def test_the_session_list_sorts_filters_searches_and_pages(browser: Any, run: Any) -> None:
    url, _, _ = run
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    watch = Watch(page)
    page.goto(url)
    page.wait_for_selector("tr.session")
    # A page of 100 of 505, one line each; newest trainer step first by default.
    assert page.inner_text("#list-count") == "505 sessions"
    assert page.inner_text("#page-info") == "1–100 of 505"
    assert page.locator("tr.session").count() == 100
    heights = page.eval_on_selector_all("tr.session", "els => els.map(e => e.offsetHeight)")
    assert max(heights) < 30, heights
    assert page.inner_text("#key-head") == "trainer_step"

    def keys() -> list[str]:
        return page.eval_on_selector_all("tr.session td.key", "els => els.map(e => e.textContent)")

    assert set(keys()[:42]) == {"11"}
    page.select_option("#sort", "trainer_step")
    page.select_option("#order", "asc")
    page.wait_for_function("document.querySelector('tr.session td.key').textContent === '0'")
    first = [int(k) for k in keys()]
    assert first == sorted(first) and first[0] == 0 and first[-1] == 2
    page.locator("#next").click()
    page.wait_for_function("document.querySelector('#page-info').textContent.startsWith('101')")
    second = [int(k) for k in keys()]
    assert second == sorted(second) and second[0] >= first[-1]
    # Rewards show rounded, and sort.
    page.select_option("#sort", "reward")
    page.select_option("#order", "desc")
    page.wait_for_selector("#sessions[data-sort='reward'][data-order='desc'][data-offset='0']")
    rewards = [number(t) for t in page.locator("tr.session td.reward").all_inner_texts()]
    assert rewards == sorted(rewards, reverse=True)
    assert all(len(t.replace("0.", "")) <= 3 for t in page.locator("td.reward").all_inner_texts())
    # Filter by a metadata key's value, then search by id.
    page.select_option("#filter-key", "group_id")
    page.select_option("#filter-value", "grpo-03-1")
    page.wait_for_function("document.querySelector('#list-count').textContent.startsWith('14 of')")
    assert page.locator("tr.session").count() == 14
    page.locator("#filters .chip button").click()
    page.wait_for_function("document.querySelector('#list-count').textContent === '505 sessions'")
    page.fill("#search", "grpo-07-2-1")
    page.wait_for_function("document.querySelector('#list-count').textContent.startsWith('5 of')")
    ids = sorted(page.eval_on_selector_all("tr.session", "els => els.map(e => e.dataset.session)"))
    assert ids == ["grpo-07-2-1", "grpo-07-2-10", "grpo-07-2-11", "grpo-07-2-12", "grpo-07-2-13"]
    watch.assert_clean()
    page.close()


# Holds the page's requests whose URL contains `window.holdFor` until the test lets them go.
HOLD_REQUESTS = """
window.held = [];
const realFetch = window.fetch;
window.fetch = (url, opts) => {
  const answer = realFetch(url, opts);
  if (!window.holdFor || !String(url).includes(window.holdFor)) return answer;
  return new Promise((resolve) => window.held.push(() => resolve(answer)));
};
"""


def test_a_late_answer_never_replaces_the_list_the_user_asked_for_last(
    browser: Any, run: Any
) -> None:
    url, _, _ = run
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    page.add_init_script(HOLD_REQUESTS)
    watch = Watch(page)
    page.goto(url)
    page.wait_for_selector("#sessions[data-answers='1'] tr.session")
    # Sort by reward (its answer held), then flip the order: the second answer comes first.
    page.evaluate("window.holdFor = 'sort=reward&order=desc'")
    page.select_option("#sort", "reward")
    page.wait_for_function("window.held.length === 1")
    page.select_option("#order", "asc")
    page.wait_for_selector("#sessions[data-sort='reward'][data-order='asc'][data-answers='2']")
    page.evaluate("window.held.forEach((release) => release())")
    page.wait_for_selector("#sessions[data-answers='3']")
    # The late answer (descending) was not drawn over the one asked for last.
    assert page.get_attribute("#sessions", "data-order") == "asc"
    assert page.input_value("#order") == "asc"
    rewards = [number(t) for t in page.locator("tr.session td.reward").all_inner_texts()]
    assert rewards == sorted(rewards)
    watch.assert_clean()
    page.close()


def test_a_row_shows_its_weight_versions_and_keeps_its_header_in_view(
    browser: Any, run: Any
) -> None:
    url, _, shots = run
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    watch = Watch(page)
    # A session whose weights moved between its two calls: v4, then v5.
    page.goto(url + "#session=grpo-04-0-4")
    page.wait_for_selector("#tree .node")
    assert page.locator("#tree .badge.version").all_inner_texts() == ["v4", "v5"]
    page.locator("#tree .node").first.click()
    page.wait_for_selector("#tokens .t.m1")
    marks = page.locator("#tokens .call-mark[data-start]").all_inner_texts()
    assert len(marks) == 2 and "weights v4" in marks[0] and "weights v5" in marks[1]
    assert "weights v4" in page.inner_text("#row-calls")
    bands = page.eval_on_selector_all("#strip rect.vband", "els => els.map(e => e.dataset.version)")
    assert bands == ["v4", "v5"]
    # The strip: a bar per sampled token (44 of them here), under the row's header.
    trained = page.locator("#tokens .t.m1").count()
    assert page.locator("#strip path.strip-lp").count() == 1
    assert (
        page.evaluate(
            "document.querySelector('#strip path.strip-lp').getAttribute('d').split('M').length - 1"
        )
        == trained
    )
    last = page.locator("#tokens .t.m1").last
    assert "weights v5" in (last.get_attribute("title") or "")
    screenshot(page, shots, "row")
    # A long row: it opens scrolled 32,000 tokens in, its header and legend still in view.
    page.goto(url + "#session=long-1&row=t-long-2")
    page.wait_for_selector("#tokens .t[data-i='32833']")
    assert page.evaluate("document.querySelector('#right').scrollTop") > 5_000
    assert in_view(page, "#legend") and in_view(page, "#row-id") and in_view(page, "#strip")
    head = page.evaluate(
        "document.querySelector('#row-head').getBoundingClientRect().top"
        " - document.querySelector('#right').getBoundingClientRect().top"
    )
    assert abs(head) < 2
    # Clicking the strip's end jumps to the row's last sampled tokens.
    box = page.locator("#strip").bounding_box()
    assert box is not None
    page.mouse.click(box["x"] + box["width"] - 2, box["y"] + 10)
    page.wait_for_selector("#tokens .t[data-i='99999']")
    screenshot(page, shots, "long-row")
    watch.assert_clean()
    page.close()


def test_the_axis_labels_keep_their_zeros(browser: Any, offline: tuple[str, Path]) -> None:
    """The plots' number format in the page (issue 51: 100k read "1k" and 150k "15k", the
    formatter stripping every trailing zero)."""
    url, _ = offline
    page = browser.new_page()
    page.goto(url)
    got = page.evaluate("[1000, 10000, 100000, 150000, 12345, 1.5e6, 2e6, 0.123, 250].map(fmtNum)")
    assert got == ["1000", "10k", "100k", "150k", "12.3k", "1.5M", "2M", "0.123", "250"]


def test_a_weight_version_keeps_one_colour(browser: Any, offline: tuple[str, Path]) -> None:
    """The strip's version bands: one colour per version (issue 51: the colour was the span's
    place in its row, so v1 after v2 took v2's colour elsewhere)."""
    url, _ = offline
    page = browser.new_page()
    page.goto(url)
    fills = page.evaluate(
        """() => {
            const data = {pos: [0, 1, 2, 3, 4, 5], end: [1, 2, 3, 4, 5, 6],
                          lp: [-1, -1, -1, -1, -1, -1], min: [-1, -1, -1, -1, -1, -1]};
            const bands = (spans) => [...strip(data, spans, [], () => {})
                .querySelectorAll("rect.vband")].map((r) => r.getAttribute("fill"));
            return [bands([{version: "v2", start: 0, end: 3}, {version: "v1", start: 3, end: 6}]),
                    bands([{version: "v1", start: 0, end: 2}, {version: "v3", start: 2, end: 4},
                           {version: "v1", start: 4, end: 6}])];
        }"""
    )
    (v2, v1), (v1_again, v3, v1_last) = fills
    assert v1 == v1_again == v1_last and len({v1, v2, v3}) == 3, fills
