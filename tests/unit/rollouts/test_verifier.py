"""The verifier's spec and its reward channel (capture/rollouts/verifier.py): one plain number,
finite, inside the range; a reward file as Harbor writes it."""

from __future__ import annotations

import pytest

from capture.rollouts.verifier import (
    RewardError,
    VerifierSpec,
    file_reward,
    parse_verifier,
    stdout_reward,
)

UNIT = (0.0, 1.0)


def test_the_last_stdout_line_is_the_reward() -> None:
    assert stdout_reward("checking\n0.25\n\n", UNIT) == 0.25
    assert stdout_reward("1", UNIT) == 1.0 and stdout_reward(" 0 \n", UNIT) == 0.0
    assert stdout_reward("1e-1\n", UNIT) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("stdout", "words"),
    [
        ("0\n1e30", 'outside the verifier\'s "reward_range" [0, 1]'),  # the 1e300 attack's shape
        ("1e300", "outside"),
        ("-0.5", "outside"),
        ("nan", "not one number"),
        ("inf", "not one number"),
        ("1_0", "not one number"),
        ("0x1", "not one number"),
        ("reward: 1", "not one number"),
        ("1 1", "not one number"),
        ("1e999", "not a finite number"),
        ("", "printed nothing on stdout"),
        ("\n \n", "printed nothing on stdout"),
    ],
)
def test_anything_but_one_number_in_range_is_no_reward(stdout: str, words: str) -> None:
    with pytest.raises(RewardError, match=None) as caught:
        stdout_reward(stdout, UNIT)
    assert words in str(caught.value)


def test_a_wider_range_is_the_verifiers_to_give() -> None:
    assert stdout_reward("7", (0.0, 10.0)) == 7.0
    with pytest.raises(RewardError):
        stdout_reward("11", (0.0, 10.0))


def test_the_reward_file_holds_a_number_or_named_rewards() -> None:
    assert file_reward("0.5\n", UNIT) == (0.5, {})
    assert file_reward('{"reward": 1, "style": 3}', UNIT) == (1.0, {"reward": 1.0, "style": 3.0})
    assert file_reward('{"tests": 0.75}', UNIT) == (0.75, {"tests": 0.75})
    for bad, words in [
        ('{"a": 0.5, "b": 0.5}', 'none is "reward"'),
        ("{}", "empty"),
        ('{"reward": "1"}', "not a number"),
        ('{"reward": true}', "not a number"),
        ('{"reward": 2}', "outside"),
        ("{not json", "neither a number nor a JSON object"),
        ("1e300", "outside"),
    ]:
        with pytest.raises(RewardError) as caught:
            file_reward(bad, UNIT)
        assert words in str(caught.value), bad


def test_a_verifier_spec_is_parsed_strictly() -> None:
    assert parse_verifier(["sh", "-c", "echo 1"], False) == VerifierSpec(
        command=("sh", "-c", "echo 1")
    )
    spec = parse_verifier(
        {"pytest": ["tests/t.py::a"], "keep": ["src/**/*.py"], "reward_range": [-1, 1]}, True
    )
    assert spec.pytest == ("tests/t.py::a",) and spec.keep == ("src/**/*.py",)
    assert spec.reward_range == (-1.0, 1.0) and spec.command == ()
    for body, words in [
        ({"command": ["t"], "pytest": ["x"]}, "one of"),
        ({}, "one of"),
        ({"command": ["t"], "junk": 1}, "not junk"),
        ({"command": []}, "non-empty list"),
        ({"command": ["t"], "keep": ["/etc/passwd"]}, "relative"),
        ({"command": ["t"], "keep": ["../x"]}, "relative"),
        ({"command": ["t"], "reward_range": [1, 0]}, "lo < hi"),
        ({"command": ["t"], "reward_range": [0, float("inf")]}, "finite"),
        ({"command": ["t"], "python": "/usr/bin/python3"}, "goes with"),
        ({"pytest": ["x"], "python": "python3"}, "absolute path"),
        ({"command": ["t"], "on_error": "x"}, "on_error"),
    ]:
        with pytest.raises(ValueError) as caught:
            parse_verifier(body, True)
        assert words in str(caught.value), body


def test_keep_and_pytest_want_a_seed_workdir() -> None:
    for body in ({"command": ["t"], "keep": ["*.py"]}, {"pytest": ["x"]}):
        with pytest.raises(ValueError, match="seed"):
            parse_verifier(body, False)
