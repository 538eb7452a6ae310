"""rewriter/vllm_stream.py: a read's lines as pieces (``read_pieces``) and when pieces go on
(``Pacer``, ``agenttap_stream_flush_ms``), on a clock the test moves."""

from __future__ import annotations

import json

from rewriter.vllm_answers import CompletionDelta, completions_delta
from rewriter.vllm_stream import LineSplitter, Pacer, read_pieces


def piece(token: int, finish: str | None = None) -> CompletionDelta:
    return CompletionDelta(f" t{token}", [token], [-0.5], finish_reason=finish)


def tokens(out: list[CompletionDelta]) -> list[list[int]]:
    return [p.token_ids for p in out]


def test_without_an_interval_each_read_goes_on_at_once() -> None:
    pacer = Pacer(0)
    assert tokens(pacer.take([piece(1), piece(2)], 0.0, False)) == [[1, 2]]
    assert tokens(pacer.take([piece(3)], 0.001, False)) == [[3]]
    assert not pacer.holding(0.001)


def test_the_first_goes_at_once_then_no_sooner_than_the_interval() -> None:
    pacer = Pacer(0.05)
    assert tokens(pacer.take([piece(1)], 10.0, False)) == [[1]]  # the first: at once
    assert pacer.take([piece(2)], 10.01, False) == []  # within the interval: held
    assert pacer.holding(10.01) and not pacer.holding(10.05)
    assert pacer.take([piece(3)], 10.03, False) == []
    # The interval is over: what waited goes on as one piece, and a new interval starts.
    assert tokens(pacer.take([], 10.05, False)) == [[2, 3]]
    assert pacer.take([piece(4)], 10.06, False) == []
    assert tokens(pacer.take([piece(5)], 10.2, False)) == [[4, 5]]  # late: at once


def test_a_finish_or_the_end_lets_everything_go_at_once() -> None:
    pacer = Pacer(60)
    pacer.take([piece(1)], 0.0, False)
    assert pacer.take([piece(2)], 0.1, False) == []
    out = pacer.take([piece(3, "stop")], 0.2, True)
    assert tokens(out) == [[2, 3]] and out[0].finish_reason == "stop"
    assert not pacer.holding(0.3)


def test_reads_of_keep_alives_start_no_interval() -> None:
    pacer = Pacer(0.05)
    assert pacer.take([], 1.0, False) == []  # nothing read yet: nothing starts
    assert tokens(pacer.take([piece(1)], 1.01, False)) == [[1]]


def test_release_hands_on_what_waits() -> None:
    pacer = Pacer(60)
    pacer.take([piece(1)], 0.0, False)
    pacer.take([piece(2)], 0.1, False)
    pacer.take([piece(3)], 0.2, False)
    out = pacer.release()
    assert tokens(out) == [[2, 3]] and not out[0].more
    assert pacer.release() == []


def line(choice: dict[str, object]) -> bytes:
    return b"data: " + json.dumps({"choices": [choice]}).encode()


def test_a_reads_lines_become_pieces_keep_alives_left_out() -> None:
    tok = {"text": " a", "logprobs": {"token_logprobs": [-1.0], "tokens": ["token_id:7"]}}
    keep_alive = {"text": "", "token_ids": [], "logprobs": None, "finish_reason": None}
    finish = {"text": "", "token_ids": [], "finish_reason": "stop", "stop_reason": 151645}
    split = LineSplitter()
    raw = b"\n\n".join([line(tok), b": ping", line(keep_alive), line(finish), b"data: [DONE]", b""])
    read = read_pieces(split.feed(raw), completions_delta, fast=True)
    assert [(p.text, p.token_ids, p.finish_reason) for p in read.pieces] == [
        (" a", [7], None),
        ("", [], "stop"),
    ]
    assert read.progress and read.finished and read.done and read.error is None
    only_alive = read_pieces(split.feed(line(keep_alive) + b"\n\n"), completions_delta, True)
    assert only_alive.pieces == [] and not only_alive.progress


def test_a_bad_line_is_the_error_after_the_pieces_before_it() -> None:
    tok = {"text": " a", "token_ids": [7], "logprobs": {"token_logprobs": [-1.0]}}
    lines = [line(tok), b"data: {not json", line(tok)]
    for fast in (True, False):
        read = read_pieces(lines, completions_delta, fast)
        assert tokens(read.pieces) == [[7]]
        assert read.error is not None and read.error.status == 502
