"""A ``POST /rollouts`` body as a pydantic model (capture/rollouts/spec.py ``RolloutBody``): its
errors in the words callers were always given, the first mistake of several told, and its
schema following the agent catalogue."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture.rollouts.agents import AGENTS
from capture.rollouts.spec import KNOWN, RolloutBody, read_rollout

BASE = {"agent": "codex", "prompt": "x"}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([1], "the body must be a JSON object"),
        ({}, '"prompt" must be the task, as text'),
        ({"prompt": "x"}, '"agent" must be one of claude-code, codex'),
        ({"agent": {"command": ["a", "b\x00"]}, "prompt": "x"}, '"agent.command" holds a NUL'),
        ({"agent": "codex", "prompt": "a\x00"}, '"prompt" holds a NUL character'),
        ({**BASE, "n": 2.0}, '"n" must be a whole number from 1 to 256'),
        ({**BASE, "n": None}, '"n" must be a whole number from 1 to 256'),
        ({**BASE, "workdir": 5}, '"workdir" must be a folder path'),
        ({**BASE, "workdir": "/no/such/dir"}, "is not a folder on the proxy's machine"),
        ({**BASE, "limits": [1]}, '"limits" must be an object: {"max_calls", "max_tokens", '
         '"deadline_s", "memory_mb", "pids", "disk_mb", "cpu_s", "output_mb"}'),
        ({**BASE, "limits": {"memory_mb": 0}}, '"limits.memory_mb" must be a whole number'),
        ({**BASE, "sandbox": None, "egress": None}, '"egress" must be "none"'),
        ({**BASE, "expose": ["rel"]}, '"expose" must be a list of absolute paths'),
        ({**BASE, "timeout_s": float("inf")}, '"timeout_s" must be finite'),
        ({**BASE, "timeout_s": float("nan")}, '"timeout_s" must be a number of seconds > 0'),
        ({**BASE, "timeout_s": "5"}, '"timeout_s" must be a number of seconds > 0'),
        ({**BASE, "id": 5}, '"id" must be 1 to 128 letters'),
        ({**BASE, "metadata": "t"}, '"metadata" must be a JSON object'),
        ({**BASE, "wait": "no"}, '"wait" must be true or false'),
        ({**BASE, "rows": 0}, '"rows" must be true'),
        # Several mistakes: the first in the order they have always been checked in.
        ({"agent": "codex", "prompt": "", "n": 0, "zz": 1}, "unknown field(s) zz; known: "
         + ", ".join(KNOWN)),
        ({"agent": "aider", "prompt": "", "n": 0}, '"prompt"'),
        ({"agent": "aider", "prompt": "x", "n": 0}, "unknown agent 'aider'"),
        ({**BASE, "n": 0, "seed": "s"}, '"n"'),
        ({**BASE, "seed": "s", "wait": 1}, '"seed" must be a whole number'),
        ({**BASE, "first_index": -1}, '"first_index" must be a whole number from 0'),
        ({**BASE, "first_index": 1.5}, '"first_index" must be a whole number from 0'),
    ],
)  # fmt: skip
def test_a_bad_body_is_told_its_first_mistake(body: object, words: str) -> None:
    with pytest.raises(ValueError) as exc:
        read_rollout(body)
    assert words in str(exc.value)


def test_a_body_is_read_into_the_runners_spec(tmp_path: Path) -> None:
    body = read_rollout(
        {**BASE, "workdir": str(tmp_path), "limits": {"deadline_s": 30, "memory_mb": 100},
         "expose": [str(tmp_path)], "egress": "public", "wait": False, "rows": False}
    )  # fmt: skip
    assert (body.wait, body.rows) == (False, False)
    spec = body.spec()
    assert spec.workdir == tmp_path and spec.expose == (tmp_path,) and spec.egress == "public"
    assert spec.limits == {"deadline_s": 30.0} and spec.sandbox_limits.memory_mb == 100
    assert spec.timeout_s == 90.0 and spec.id.startswith("r-")
    # Left out: the kernel's defaults and an hour.
    plain = read_rollout(dict(BASE)).spec()
    assert plain.sandbox_limits.memory_mb == 4096 and plain.timeout_s == 3600.0
    assert read_rollout({**BASE, "timeout_s": 5}).spec().timeout_s == 5.0
    # A Ray pool's share of a group: its agents numbered from first_index (0 when left out).
    assert plain.first_index == 0
    assert read_rollout({**BASE, "n": 3, "first_index": 5}).spec().first_index == 5


def test_the_schema_follows_the_catalogue() -> None:
    schema = RolloutBody.model_json_schema()
    assert set(schema["properties"]) == set(KNOWN)
    assert schema["properties"]["agent"]["oneOf"][0]["enum"] == list(AGENTS)
    assert set(schema["required"]) == {"prompt", "agent"}
    assert schema["additionalProperties"] is False
