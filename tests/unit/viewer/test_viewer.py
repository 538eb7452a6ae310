"""The viewer's data (capture/viewer/data.py): sessions, the row tree, token pages, call lists and
diffs, over shards written with the proxy's own writer; where a row opens (its first trained
token); the page's icon and which of the viewer's paths answer without the token."""

from __future__ import annotations

import asyncio
import math
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
from tests.support.viewer_data import (
    REMINDER,
    write_agent_session,
    write_long_prompt_session,
    write_long_session,
    write_run,
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


def test_only_the_page_its_scripts_and_its_icon_are_open() -> None:
    for path in ("/ui", "/ui/", "/ui/index.html", "/ui/favicon.ico", "/ui/viewer.js"):
        assert ViewerRoutes.is_page(path), path
    assert ViewerRoutes.is_page("/ui/plots.js")
    for path in ("/ui/api/sessions", "/ui/api/sessions/s/rows/t", "/ui/favicon.ico/x", "/ui/x"):
        assert not ViewerRoutes.is_page(path), path
    for path in ("/ui/api/run", "/ui/api/groups/g", "/ui/../viewer.js", "/ui/ui/viewer.js"):
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


# -- the run: 504 sessions, 36 groups, 12 steps --------------------------------------------------
@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    truth = write_run(tmp_path / "run")
    write_long_session(tmp_path / "run", tokens=3000)
    return tmp_path / "run", truth


def test_the_run_per_trainer_step(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, truth = run
    sessions = viewer.session_list(ShardSource(out).summaries())
    summary = viewer.run_summary(sessions)
    assert summary["by"] == "trainer_step" and summary["unstepped"] == 1
    assert [p["step"] for p in summary["steps"]] == [str(k) for k in range(12)]
    for point in summary["steps"]:
        members = [s for s in truth if str(s["step"]) == point["step"]]
        rewards = [s["reward"] for s in members]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        assert point["reward"]["mean"] == pytest.approx(mean)
        assert point["reward"]["std"] == pytest.approx(std)
        assert point["reward"]["min"] == min(rewards) and point["reward"]["max"] == max(rewards)
        statuses: dict[str, int] = {}
        for s in members:
            statuses[s["status"]] = statuses.get(s["status"], 0) + 1
        assert point["statuses"] == statuses and point["sessions"] == 42 and point["groups"] == 3
        assert point["tokens"] == sum(s["tokens"] for s in members)
        assert point["trained_tokens"] == sum(s["trained"] for s in members)
        span = max(s["ended_at"] for s in members) - min(s["started_at"] for s in members)
        assert point["time_s"] == pytest.approx(span)
    # Per weight version: a session counts under the newest weights that sampled it.
    by_version = viewer.run_summary(sessions, "version")
    assert [p["step"] for p in by_version["steps"]] == [f"v{k}" for k in range(13)]
    assert sum(p["sessions"] for p in by_version["steps"]) == 504
    # Any metadata key.
    by_task = viewer.run_summary(sessions, "task")
    assert [p["step"] for p in by_task["steps"]] == ["task-0", "task-1", "task-2"]


def test_a_steps_time_is_the_trainers_where_it_sent_one(
    run: tuple[Path, list[dict[str, Any]]],
) -> None:
    """Where the trainer's adapter sent its step time with the advantages, that is the step's
    time (the largest given, for a step); elsewhere the span of its calls, and each point says
    which."""
    out, _ = run
    sessions = viewer.session_list(ShardSource(out).summaries())
    own = {p["step"]: p for p in viewer.run_summary(sessions)["steps"]}
    step3 = [s["id"] for s in sessions if viewer.session_value(s, "trainer_step") == 3]
    advantages = {sid: {"advantage": 0.1, "step": 3, "step_s": 30.0} for sid in step3}
    advantages[step3[0]]["step_s"] = 31.5
    advantages["elsewhere"] = {"advantage": 0.1, "step": 4, "step_s": None}
    told = viewer.trainer_step_times(advantages)
    assert set(told) == set(step3) and told[step3[0]] == 31.5
    summary = {p["step"]: p for p in viewer.run_summary(sessions, None, told)["steps"]}
    assert (summary["3"]["time_s"], summary["3"]["time_source"]) == (31.5, "trainer")
    for step, point in summary.items():
        if step != "3":
            assert point["time_source"] == "calls"
            assert point["time_s"] == pytest.approx(own[step]["time_s"])


def test_a_group_its_rewards_and_advantages(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, truth = run
    source = ShardSource(out)
    sessions = viewer.session_list(source.summaries())
    groups = viewer.group_list(sessions)
    assert len(groups) == 36 and groups[0]["trainer_step"] == "11" and groups[0]["n"] == 14
    group = viewer.group_view(sessions, source.summaries(), "grpo-05-1")
    members = sorted((s for s in truth if s["group"] == "grpo-05-1"), key=lambda s: s["index"])
    mean = sum(s["reward"] for s in members) / len(members)
    assert [r["id"] for r in group["rollouts"]] == [s["id"] for s in members]
    for got, want in zip(group["rollouts"], members, strict=True):
        assert got["reward"] == want["reward"]
        assert got["advantage"] == pytest.approx(want["reward"] - mean)
        assert got["status"] == want["status"] and got["calls"] == 2
        assert got["trained_tokens"] == want["trained"] and got["versions"] == want["versions"]
        assert [r["thread_id"] for r in got["rows"]] == ["t-" + want["id"]]
    assert group["trainer_step"] == "5"
    with pytest.raises(LookupError, match="group_id"):
        viewer.group_view(sessions, source.summaries(), "nope")


def test_the_list_sorts_filters_searches_and_pages(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = run
    sessions = viewer.session_list(ShardSource(out).summaries())
    # By default the newest trainer step first; the session without one last.
    page = viewer.query_sessions(sessions)
    assert page["sort"] == "trainer_step" and page["matched"] == 505
    assert len(page["sessions"]) == viewer.DEFAULT_PAGE
    assert {s["metadata"]["trainer_step"] for s in page["sessions"][:42]} == {11}
    last = viewer.query_sessions(sessions, offset=500)["sessions"]
    assert [s["id"] for s in last][-1] == "long-1"
    up = viewer.query_sessions(sessions, "trainer_step", descending=False, limit=1000)
    steps = [viewer.session_value(s, "trainer_step") for s in up["sessions"]]
    assert steps[:-1] == sorted(steps[:-1]) and steps[-1] is None
    # Ties in a group by its rollouts' index.
    assert [s["id"] for s in up["sessions"][:3]] == ["grpo-00-0-0", "grpo-00-0-1", "grpo-00-0-2"]
    by_reward = viewer.query_sessions(sessions, "reward")["sessions"]
    rewards = [float(viewer.reward_of(s) or 0.0) for s in by_reward]
    assert rewards == sorted(rewards, reverse=True)
    group = viewer.query_sessions(sessions, filters=[("group_id", "grpo-03-1")])
    assert group["matched"] == 14
    both = viewer.query_sessions(sessions, filters=[("trainer_step", "3"), ("status", "stop")])
    assert all(s["status"] == "stop" for s in both["sessions"]) and 0 < both["matched"] < 42
    found = viewer.query_sessions(sessions, search="GRPO-07-2-1")
    assert found["matched"] == 5
    with pytest.raises(ValueError, match="limit"):
        viewer.query_sessions(sessions, limit=viewer.MAX_PAGE + 1)
    keys = {k["key"]: k for k in viewer.metadata_keys(sessions)}
    assert keys["trainer_step"]["distinct"] == 12 and keys["trainer_step"]["values"][:3] == [
        "0",
        "1",
        "2",
    ]
    assert keys["group_id"]["sessions"] == 504


def test_text_sorts_in_natural_order() -> None:
    values = ("v10", "v2", "v1", None, "3")
    sessions = [{"id": f"s{k}", "metadata": {"k": v}} for k, v in enumerate(values)]
    order = viewer.query_sessions(sessions, "k", descending=False)["sessions"]
    assert [s["metadata"]["k"] for s in order] == ["3", "v1", "v2", "v10", None]


def test_a_row_says_which_weights_sampled_each_call(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = run
    row = ShardSource(out).threads("grpo-04-0-4")[0]
    node = viewer.row_node(row)
    assert node["versions"] == ["v4", "v5"]
    assert [t["versions"] for t in node["turns"]] == [["v4"], ["v5"]]
    assert viewer.versions_in(node["weight_versions"], 0, 3) == []


def test_the_logprob_strip(run: tuple[Path, list[dict[str, Any]]], out: Path) -> None:
    row = ShardSource(run[0]).threads("grpo-04-0-4")[0]
    strip = viewer.row_overview(row)["strip"]
    sampled = [i for i, p in enumerate(row["provenance"]) if p == 1]
    assert strip["bucket"] == 1 and strip["pos"] == sampled and strip["entropy"] is None
    assert strip["lp"] == [round(row["logprobs"][i], 4) for i in sampled]
    # 1,500 sampled tokens: two per point, each point their mean and min.
    long_row = ShardSource(out).threads("long-1")[0]
    strip = viewer.logprob_strip(long_row)
    assert strip["bucket"] == 2 and len(strip["pos"]) == 750
    a, b = strip["pos"][0], strip["pos"][0] + 1
    lps = long_row["logprobs"]
    assert strip["lp"][0] == pytest.approx((lps[a] + lps[b]) / 2, abs=1e-4)
    assert strip["min"][0] == pytest.approx(min(lps[a], lps[b]), abs=1e-4)
    # With top-k logprobs, the entropy of each point's top-k.
    top = [[math.log(0.5), math.log(0.5)] if i in sampled else None for i in range(len(lps))]
    strip = viewer.logprob_strip(dict(row, top_logprobs=top))
    assert strip["entropy"] == [pytest.approx(math.log(2), abs=1e-4)] * len(sampled)
    assert viewer.entropy([0.0]) == 0.0 and viewer.entropy(None) is None


def test_the_run_routes(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, _ = run
    routes = ViewerRoutes(ShardSource(out), viewer.ids_only, "test")

    async def go() -> None:
        async with TestClient(TestServer(offline_app(routes))) as client:
            for name in ("viewer.js", "plots.js"):
                resp = await client.get(f"/ui/{name}")
                assert resp.status == 200 and resp.content_type == "text/javascript"
            query = "sort=trainer_step&order=asc&filter=group_id=grpo-03-1&limit=5&offset=5"
            page = await (await client.get(f"/ui/api/sessions?{query}")).json()
            assert page["matched"] == 14 and len(page["sessions"]) == 5 and page["offset"] == 5
            assert "trainer_step" in {k["key"] for k in page["keys"]}
            for bad, says in (
                ("filter=group_id", "KEY=VALUE"),
                ("order=up", "asc or desc"),
                ("limit=0", "limit"),
            ):
                resp = await client.get(f"/ui/api/sessions?{bad}")
                assert resp.status == 400 and says in (await resp.json())["error"]["message"]
            run_view = await (await client.get("/ui/api/run")).json()
            assert len(run_view["steps"]) == 12 and run_view["group_count"] == 36
            by = await (await client.get("/ui/api/run?by=version")).json()
            assert by["by"] == "version" and len(by["steps"]) == 13
            group = await (await client.get("/ui/api/groups/grpo-03-1")).json()
            assert len(group["rollouts"]) == 14
            missing = await client.get("/ui/api/groups/nope")
            assert (
                missing.status == 404 and "group_id" in (await missing.json())["error"]["message"]
            )

    asyncio.run(go())


def test_the_viewer_on_an_examples_folder_names_its_shards_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m capture.viewer train-grpo`` (the example's --out, its rows one folder down in
    shards/): the error names the folder meant (issue 51)."""
    from capture.viewer.http import main

    write_run(tmp_path / "train-grpo" / "shards")
    (tmp_path / "train-grpo" / "weights").mkdir()
    assert main([str(tmp_path / "train-grpo")]) == 2
    said = capsys.readouterr().err
    assert "holds no threads/ or turns/ folder" in said
    assert f"Did you mean {tmp_path / 'train-grpo' / 'shards'}" in said, said


def test_another_run_is_read_from_its_folder_and_a_folder_without_one_is_refused(
    run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    from capture.viewer.sources import OtherRuns

    out, truth = run
    others = OtherRuns(keep=1)
    source = others.source(str(out))
    assert source is others.source(str(out))  # kept for the next ask
    steps = viewer.run_summary(viewer.session_list(source.summaries()))["steps"]
    assert sum(s["sessions"] for s in steps) == len(truth)
    with pytest.raises(ValueError, match="not an agenttap output folder"):
        others.source(str(tmp_path))
