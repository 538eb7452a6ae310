"""bench/call_budget.py's charging of py-spy's samples to the steps of a call: the innermost
frame that belongs to a step decides, the frames around every callback decide nothing, and an
fsync's wait is no CPU."""

from __future__ import annotations

from bench.call_budget import OTHER, budget

LOOP = (
    "<module> (mitmdump:6);mitmdump (mitmproxy/tools/main.py:166);"
    "BaseEventLoop._run_once (asyncio/base_events.py:1971);Handle._run (asyncio/events.py:84)"
)


def test_each_sample_goes_to_the_step_of_its_innermost_frame() -> None:
    raw = "\n".join(
        [
            # The gateway streams vLLM's answer: the parse of its line is the policy's step.
            f"{LOOP};Gateway._serve (capture/gateway.py:424);"
            "read_pieces (rewriter/vllm_stream.py:136) 5",
            # A journal line written while answering: recording.
            f"{LOOP};Gateway._serve (capture/gateway.py:424);"
            "append_line (capture/storage/journal_files.py:44) 2",
            # mitmproxy's own work.
            f"{LOOP};Layer.handle_event (mitmproxy/proxy/layer.py:144) 3",
            # The loop waiting on epoll: mitmdump's main around it is not mitmproxy's step.
            "<module> (mitmdump:6);mitmdump (mitmproxy/tools/main.py:166);"
            "EpollSelector.select (selectors.py:468) 4",
            # A worker in an fsync: left out.
            "_bootstrap (threading.py:1002);_WorkItem.run (concurrent/futures/thread.py:58);"
            "sync_journal (capture/storage/journal_sync.py:81) 7",
            "py-spy> a line of its own 9x",
        ]
    )
    steps, left_out, rest = budget(raw)
    by_word = {name.split(":")[0]: count for name, count in steps.items()}
    assert by_word == {"policy": 5, "record": 2, "mitmproxy": 3, OTHER.split(":")[0]: 4}
    assert left_out == 7
    assert list(rest) == [
        "EpollSelector.select (selectors.py:468) < mitmdump (mitmproxy/tools/main.py:166) < <module> (mitmdump:6)"
    ]
