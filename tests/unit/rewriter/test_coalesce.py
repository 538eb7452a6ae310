"""``coalesce``: the pieces of one read as one, with every token's id and logprob kept."""

from __future__ import annotations

import random

from rewriter.parsers import ContentDelta, OutputParser, ReasoningDelta, ToolCallEvent
from rewriter.vllm_answers import Completion, CompletionDelta, coalesce


def pieces_of(text: str, rng: random.Random) -> list[CompletionDelta]:
    """``text`` as a stream of one-token pieces (a token: 1 to 4 characters), the last one
    finishing it, the stream's ids and logprobs made up."""
    out: list[CompletionDelta] = []
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 4)
        i = len(out)
        out.append(CompletionDelta(text[pos : pos + step], [1000 + i], [-0.01 * i]))
        pos += step
    out[-1].finish_reason, out[-1].stop_reason = "stop", 151645
    return out


def extended(pieces: list[CompletionDelta]) -> Completion:
    whole = Completion()
    for piece in pieces:
        whole.extend(piece)
    return whole


def test_a_lone_piece_is_left_as_it_is() -> None:
    piece = CompletionDelta("a", [1], [-0.5])
    assert coalesce([piece])[0] is piece
    assert coalesce([]) == []


def test_a_run_becomes_one_piece_with_every_token() -> None:
    run = [
        CompletionDelta("He", [10], [-0.1], backend="http://a"),
        CompletionDelta("llo", [11, 12], [-0.2, -0.3], backend="http://a"),
        CompletionDelta(
            "!",
            [13],
            [-0.4],
            finish_reason="length",
            stop_reason=None,
            weight_versions=[("v1", 0, 4)],
            backend="http://a",
        ),
    ]
    (one,) = coalesce(run)
    assert one.text == "Hello!"
    assert one.token_ids == [10, 11, 12, 13]
    assert one.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert one.finish_reason == "length" and one.weight_versions == [("v1", 0, 4)]
    assert one.backend == "http://a"
    # The pieces themselves are not changed (they may be someone else's).
    assert run[0].token_ids == [10] and run[0].text == "He"


def test_a_finish_ends_a_run() -> None:
    """An abort (the server resumes the generation after it) or a finish stays the last of
    its piece: what follows is not folded into it."""
    pieces = [
        CompletionDelta("a", [1], [-1.0]),
        CompletionDelta("b", [2], [-2.0], finish_reason="abort"),
        CompletionDelta("c", [3], [-3.0]),
        CompletionDelta("d", [4], [-4.0]),
    ]
    out = coalesce(pieces)
    assert [(p.text, p.token_ids, p.finish_reason) for p in out] == [
        ("ab", [1, 2], "abort"),
        ("cd", [3, 4], None),
    ]


def test_extending_by_coalesced_pieces_gives_the_same_completion() -> None:
    """The recorded completion (ids, logprobs, spans, servers, finish) is the same however
    the pieces were grouped into reads."""
    rng = random.Random(41)
    for _ in range(200):
        pieces = pieces_of("The answer is forty-one, as computed.", rng)
        for i, piece in enumerate(pieces):
            piece.backend = "http://a" if i < len(pieces) // 2 else "http://b"
            if rng.random() < 0.2:
                piece.weight_versions = [(rng.choice(["v1", "v2"]), i, i + 1)]
        reads: list[list[CompletionDelta]] = []
        i = 0
        while i < len(pieces):
            n = rng.randint(1, 6)
            reads.append(pieces[i : i + n])
            i += n
        # A read's pieces come from one server: split the reads where the server changes.
        grouped = [
            [p for p in read if p.backend == server]
            for read in reads
            for server in dict.fromkeys(p.backend for p in read)
        ]
        merged = [piece for read in grouped for piece in coalesce(read)]
        assert len(merged) <= len(pieces)
        assert extended(merged) == extended(pieces)


def by_kind(events: list[object]) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(e.call.name, e.call.arguments) for e in events if isinstance(e, ToolCallEvent)]
    return reasoning, content, calls


def test_coalesced_text_parses_as_the_tokens_did() -> None:
    """The parsers see all of the text whichever way it is grouped: reasoning, content and
    tool calls come out the same, and each event is of one kind only (a merged text across
    ``</think>`` or ``<tool_call>`` is split there)."""
    text = (
        "<think>\nLet me look it up.\n</think>\n\nLooking it up.\n"
        '<tool_call>\n{"name": "lookup", "arguments": {"q": "41"}}\n</tool_call>'
    )
    rng = random.Random(7)
    one_by_one = OutputParser("hermes", "qwen3")
    events: list[object] = []
    pieces = pieces_of(text, rng)
    for piece in pieces:
        events += one_by_one.feed(piece.text)
    events += one_by_one.finish()
    for size in (2, 3, 5, 8, len(pieces)):
        parser = OutputParser("hermes", "qwen3")
        got: list[object] = []
        for start in range(0, len(pieces), size):
            for piece in coalesce(pieces[start : start + size]):
                got += parser.feed(piece.text)
        got += parser.finish()
        assert by_kind(got) == by_kind(events)
        assert len(got) <= len(events)
        assert parser.reply().content == one_by_one.reply().content
        assert parser.reply().reasoning == one_by_one.reply().reasoning
