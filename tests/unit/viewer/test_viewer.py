"""The viewer's data (capture/viewer/data.py): sessions, the row tree, token pages, call lists and
diffs, over shards written with the proxy's own writer; where a row opens (its first trained
token); the page's icon and which of the viewer's paths answer without the token."""

from __future__ import annotations

import asyncio
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from capture.storage.rewards import write_rewards
from capture.viewer import data as viewer
from capture.viewer.data import ShardSource
from capture.viewer.http import ViewerRoutes, icon, offline_app
from tests.viewer_data import (
    REMINDER,
    write_agent_session,
    write_long_prompt_session,
    write_long_session,
)


@pytest.fixture
def out(tmp_path: Path, tok: Any) -> Path:
    write_agent_session(tmp_path, tok)
    write_long_session(tmp_path, tokens=30_000)
    return tmp_path


def test_sessions_list_rows_calls_tokens_reward_metadata(out: Path) -> None:
    sessions = {s["id"]: s for s in viewer.session_list(ShardSource(out).summaries())}
    agent = sessions["agent-1"]
    assert agent["rows"] == 4 and agent["dead_rows"] == 1
    assert agent["calls"] == 5  # every row trains its own calls once
    assert agent["reward"] == 1.0 and agent["end_reason"] == "stop"
    assert agent["metadata"] == {"task_id": "swe-42", "group_id": "g-7", "split": "train"}
    assert sessions["long-1"]["tokens"] == 30_000
    assert sessions["long-1"]["trained_tokens"] == 1500 and not sessions["long-1"]["live"]


def test_a_late_reward_shows_once_written(out: Path) -> None:
    source = ShardSource(out)
    assert {s["id"]: s["reward"] for s in viewer.session_list(source.summaries())}["long-1"] == 0.5
    write_rewards(out, "long-1", -2.0)
    assert {s["id"]: s["reward"] for s in viewer.session_list(source.summaries())}["long-1"] == -2.0
    assert source.threads("long-1")[0]["reward"] == -2.0


def test_live_sessions_are_listed_before_they_have_rows(out: Path) -> None:
    live = {"fresh": {"metadata": {"task_id": "t9"}, "closed": False, "metrics": {"calls": 0}}}
    sessions = {s["id"]: s for s in viewer.session_list(ShardSource(out).summaries(), live)}
    assert sessions["fresh"]["live"] and sessions["fresh"]["rows"] == 0
    assert sessions["fresh"]["metadata"] == {"task_id": "t9"}


def test_the_tree_hangs_branches_spawns_and_rewrites_off_their_parent(out: Path) -> None:
    roots = viewer.row_tree(ShardSource(out).threads("agent-1"))
    assert [r["thread_id"] for r in roots] == ["t-req-1"]
    children = {c["thread_id"]: c for c in roots[0]["children"]}
    assert children["t-req-0b"]["dead"] and children["t-req-0b"]["parent_relation"] == "branch"
    assert children["t-req-sub"]["parent_relation"] == "spawn"
    assert children["t-req-sub"]["parent_tool_call_id"] == "call_abc"
    assert children["t-req-2"]["parent_relation"] == "rewritten"
    assert [t["request_id"] for t in roots[0]["turns"]] == ["req-0", "req-1"]


def test_a_page_of_tokens_is_decoded_with_mask_provenance_and_logprobs(out: Path, tok: Any) -> None:
    row = next(r for r in ShardSource(out).threads("agent-1") if r["thread_id"] == "t-req-1")
    decode = viewer.tokenizer_decoder(tok)
    page = viewer.token_page(row, decode, 0, 10_000)
    assert page["total"] == len(row["input_ids"]) == len(page["text"])
    # Decoded token by token, the pieces are the row's text.
    assert "".join(page["text"]) == tok.decode(row["input_ids"])
    start, end = row["turns"][0]["start"], row["turns"][0]["end"]
    assert "".join(page["text"][start:end]).startswith("<tool_call>")
    assert page["provenance"][start:end] == [1] * (end - start)
    assert page["loss_mask"][start - 1] == 0 and page["loss_mask"][start] == 1
    assert page["logprobs"][start] == pytest.approx(row["logprobs"][start], abs=1e-5)
    second = viewer.token_page(row, decode, 5, 3)
    assert second["ids"] == row["input_ids"][5:8] and second["offset"] == 5
    with pytest.raises(ValueError, match="offset"):
        viewer.token_page(row, decode, len(row["input_ids"]) + 1, 10)
    with pytest.raises(ValueError, match="limit"):
        viewer.token_page(row, decode, 0, viewer.MAX_PAGE_TOKENS + 1)
    overview = viewer.row_overview(row)
    assert overview["trained"] == sum(row["loss_mask"]) and overview["provenance"]["stale"] == 0


def test_without_a_tokenizer_tokens_show_as_ids(out: Path) -> None:
    row = ShardSource(out).threads("long-1")[0]
    page = viewer.token_page(row, viewer.ids_only, 0, 3)
    assert page["text"] == [f"⟨{i}⟩" for i in row["input_ids"][:3]]


def test_calls_carry_the_tool_calls_the_client_was_given(out: Path) -> None:
    calls = viewer.call_list(ShardSource(out).turns("agent-1"))
    assert [c["request_id"] for c in calls] == ["req-0", "req-1", "req-2", "req-0b", "req-sub"]
    first = calls[0]
    assert first["tool_calls"] == [{"name": "read_file", "arguments": '{"path": "src/app.py"}'}]
    assert first["response_finish_reason"] == "tool_calls" and calls[1]["tool_calls"] == []


def test_the_diff_of_two_calls_shows_what_the_scaffold_rewrote(out: Path, tok: Any) -> None:
    turns = {t["request_id"]: t for t in ShardSource(out).turns("agent-1")}
    decode = viewer.tokenizer_decoder(tok)
    extended = viewer.diff_calls(turns["req-0"], turns["req-1"], decode)
    assert extended["extends"] and [o["op"] for o in extended["ops"]] == ["equal", "insert"]
    assert "<tool_response>" in extended["ops"][1]["b"]["text"]
    rewritten = viewer.diff_calls(turns["req-1"], turns["req-2"], decode)
    assert not rewritten["extends"]
    added = "".join(o["b"]["text"] for o in rewritten["ops"] if "b" in o)
    assert REMINDER in added and "Thanks" in added
    assert rewritten["kept"] == len(turns["req-1"]["prompt_ids"]) + len(
        turns["req-1"]["completion_ids"]
    )


def test_a_long_diff_shortens_what_is_unchanged(out: Path) -> None:
    turns = ShardSource(out).turns("long-1")
    d = viewer.diff_calls(turns[0], turns[1], viewer.ids_only)
    equal = d["ops"][0]
    assert equal["op"] == "equal" and equal["a"]["elided"] == equal["a"]["tokens"] - 80
    assert d["extends"]


def test_the_source_sees_new_shards(out: Path, tok: Any) -> None:
    source = ShardSource(out)
    before = {s["id"] for s in viewer.session_list(source.summaries())}
    write_agent_session(out, tok, sid="agent-2")
    after = {s["id"] for s in viewer.session_list(source.summaries())}
    assert after - before == {"agent-2"}
    assert len(source.threads("agent-2")) == 4


def test_the_first_trained_token_is_where_the_mask_turns_one() -> None:
    assert viewer.first_trained([0] * 12_000 + [1, 1, 0, 1]) == 12_000
    assert viewer.first_trained([1, 0]) == 0
    assert viewer.first_trained([0, 0, 0]) is None
    assert viewer.first_trained([]) is None and viewer.first_trained(None) is None


def test_rows_carry_their_first_trained_token(out: Path, tmp_path: Path) -> None:
    long_row = ShardSource(out).threads("long-1")[0]
    node = viewer.row_tree([long_row])[0]
    # The first call's sampled tokens: 30,000 // 3 - 500 prompt tokens in.
    assert node["first_trained"] == 9500 == long_row["turns"][0]["start"]
    assert viewer.row_overview(long_row)["first_trained"] == 9500
    prompt_dir = tmp_path / "prompt"
    write_long_prompt_session(prompt_dir)
    row = ShardSource(prompt_dir).threads("prompt-1")[0]
    assert viewer.row_node(row)["first_trained"] == 12_000
    # A summary (no token lists read) does not know it; a row that trains nothing has none.
    summary = next(s for s in ShardSource(out).summaries() if s["session_id"] == "long-1")
    assert viewer.row_node(summary)["first_trained"] is None
    untrained = dict(row, loss_mask=[0] * len(row["loss_mask"]))
    assert viewer.row_node(untrained)["first_trained"] is None


def test_the_icon_is_an_ico_holding_a_png() -> None:
    data = icon()
    reserved, kind, count = struct.unpack("<HHH", data[:6])
    width, height, _, _, _, bpp, size, offset = struct.unpack("<BBBBHHII", data[6:22])
    assert (reserved, kind, count) == (0, 1, 1) and (width, height, bpp) == (32, 32, 32)
    png = data[offset:]
    assert len(png) == size and png.startswith(b"\x89PNG\r\n\x1a\n")
    # Every PNG chunk's CRC is right (a browser drops a broken icon).
    pos = 8
    kinds = []
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind_data = png[pos + 4 : pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind_data) == crc
        kinds.append(kind_data[:4])
        pos += 12 + length
    assert kinds == [b"IHDR", b"IDAT", b"IEND"]


def test_only_the_page_and_its_icon_are_open() -> None:
    for path in ("/ui", "/ui/", "/ui/index.html", "/ui/favicon.ico"):
        assert ViewerRoutes.is_page(path), path
    for path in ("/ui/api/sessions", "/ui/api/sessions/s/rows/t", "/ui/favicon.ico/x", "/ui/x"):
        assert not ViewerRoutes.is_page(path), path


def test_the_offline_app_serves_the_icon_and_the_overview_on_request(out: Path) -> None:
    routes = ViewerRoutes(ShardSource(out), viewer.ids_only, "test")

    async def run() -> None:
        async with TestClient(TestServer(offline_app(routes))) as client:
            for path in ("/ui/favicon.ico", "/favicon.ico"):
                resp = await client.get(path)
                assert resp.status == 200 and resp.content_type == "image/x-icon"
                assert await resp.read() == icon()
            assert (await client.post("/ui/favicon.ico")).status == 405
            page = await (await client.get("/ui/")).text()
            assert '<link rel="icon" href="favicon.ico"' in page
            rows = "/ui/api/sessions/long-1/rows/t-long-2"
            first = await (await client.get(f"{rows}?offset=0&limit=5")).json()
            assert first["overview"]["first_trained"] == 9500
            later = await (await client.get(f"{rows}?offset=9500&limit=5")).json()
            assert "overview" not in later and later["loss_mask"] == [1] * 5
            asked = await (await client.get(f"{rows}?offset=9500&limit=5&overview=1")).json()
            assert asked["overview"]["trained"] == 1500

    asyncio.run(run())
