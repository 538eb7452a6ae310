"""An agent-chosen string in a log line stays on that line and reads as it is
(capture/logs/escape.py)."""

from __future__ import annotations

import pytest

from capture.logs.escape import printable


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("x\nagenttap: rollout r done: ok", "x\\nagenttap: rollout r done: ok"),
        ("a\rb\tc", "a\\rb\\tc"),
        ("\x00\x07\x1b[2J\x7f", "\\x00\\x07\\x1b[2J\\x7f"),
        ("c1 \x85 \x9b", "c1 \\x85 \\x9b"),  # NEL and the 8-bit CSI
        ("line\u2028para\u2029", "line\\u2028para\\u2029"),
        ("evil\u202etxt.exe", "evil\\u202etxt.exe"),  # right-to-left override
        ("\u2066\u2067\u2068\u2069\u200e\u200f\u061c", "\\u2066\\u2067\\u2068\\u2069\\u200e\\u200f\\u061c"),
        ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),
        ("no\xa0break", "no\\xa0break"),
        ("bytes\udcff", "bytes\\udcff"),  # an undecodable file name (surrogateescape)
        ("tag\U000e0041", "tag\\U000e0041"),
    ],
)  # fmt: skip
def test_controls_separators_and_bidi_are_escaped(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(text).isprintable()


@pytest.mark.parametrize(
    "text", ["", "tests/test_a.py", "a b c", "données/中文/😀", "back\\slash", "'quoted'"]
)
def test_printable_text_is_kept_as_it_is(text: str) -> None:
    assert printable(text) == text
