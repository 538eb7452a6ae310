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
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from tests.conftest import QWEN3, REPO
from tests.stub_vllm import StubPolicy
from tests.viewer_data import (
    HOSTILE_REQUEST,
    HOSTILE_SESSION,
    HOSTILE_TEXT,
    REMINDER,
    TOOL_CALL,
    write_agent_session,
    write_hostile_session,
    write_long_prompt_session,
    write_long_session,
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


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory, tok: Any) -> Iterator[tuple[str, Path]]:
    """``python -m capture.viewer_http OUT --tokenizer DIR``, as a user runs it."""
    out = tmp_path_factory.mktemp("viewer-out")
    write_agent_session(out, tok)
    write_long_session(out)
    write_long_prompt_session(out)
    write_hostile_session(out, tok)
    proc = subprocess.Popen(
        [sys.executable, "-m", "capture.viewer.http", str(out), "--tokenizer", str(QWEN3)]
        + ["--port", "0"],
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
        yield match.group(1), out
    finally:
        proc.terminate()
        proc.wait(10)


def test_offline_sessions_tree_tokens_and_calls(browser: Any, offline: tuple[str, Path]) -> None:
    url, out = offline
    page = browser.new_page()
    watch = Watch(page)
    page.goto(url)
    page.wait_for_selector("tr.session[data-session='agent-1']")
    assert str(out.resolve()) in page.inner_text("#source")
    agent = page.locator("tr.session[data-session='agent-1']")
    text = agent.inner_text()
    assert "task_id=swe-42" in text and "4 (1 dead)" in text and "stop" in text
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
    page.wait_for_selector("#pick", state="visible")
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
