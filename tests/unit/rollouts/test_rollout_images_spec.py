"""What a POST /rollouts body with an "image" or a Harbor "task" asks for (pure: no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture.isolation.containers import limit_flags
from capture.rollouts.spec import parse_rollout

TASKS = Path(__file__).resolve().parents[2] / "fixtures" / "tasks"
HARBOR = TASKS / "harbor-fix-script"


def test_a_harbor_task_fills_in_its_prompt_limits_timeouts_and_verifier() -> None:
    spec = parse_rollout({"agent": "mini-swe-agent", "task": str(HARBOR)})
    assert spec.task is not None and spec.task.cpus == 1.0
    assert spec.prompt == spec.task.prompt and "report.py" in spec.prompt
    # task.toml: memory_mb 1024, storage_mb 1024 (RAM: at most half the memory), 300 s.
    assert (spec.sandbox_limits.memory_mb, spec.sandbox_limits.disk_mb) == (1024, 512)
    assert spec.timeout_s == 300.0
    assert spec.verifier is not None and spec.verifier.harbor
    assert spec.verifier.command == ("bash", "/tests/test.sh")
    assert spec.verifier.tests == HARBOR / "tests" and spec.verifier.timeout_s == 60.0
    # The caller's own settings win, and tune the task's verifier.
    spec = parse_rollout(
        {
            "agent": "mini-swe-agent",
            "task": str(HARBOR),
            "prompt": "mine",
            "limits": {"memory_mb": 2048},
            "verifier": {"on_error": "score"},
        }
    )
    assert spec.prompt == "mine" and spec.sandbox_limits.memory_mb == 2048
    assert spec.verifier is not None and spec.verifier.harbor
    assert spec.verifier.on_error == "score"


def test_the_engine_caps_cores_where_a_task_asks() -> None:
    assert limit_flags(1.0) == ["--cpus=1"] and limit_flags(None) == []


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"image": "Bad Ref"}, '"image" must be an image reference'),
        ({"image": "localhost/x:1", "workdir": "/tmp"}, '"image" and "workdir"'),
        ({"cwd": "/x"}, '"cwd" is the folder inside the "image"'),
        ({"image": "localhost/x:1", "cwd": "x"}, '"cwd" must be an absolute path'),
        ({"image": "localhost/x:1", "cwd": "/a/../b"}, 'must not hold ".."'),
        ({"image": "localhost/x:1", "sandbox": "bwrap"}, '"sandbox" and "image"'),
        ({"verifier": {"command": ["x"], "tests": "/tmp"}}, '"verifier.tests" is shown'),
        ({"task": "relative"}, '"task" must be the absolute path'),
        ({"task": str(HARBOR), "image": "localhost/x:1"}, '"task" and "image"'),
        ({"task": "/nonexistent-task-folder"}, "nonexistent-task-folder"),
        (
            {"image": "localhost/x:1", "verifier": {"pytest": ["t.py::a"]}},
            '"verifier.pytest" runs the proxy',
        ),
    ],
)
def test_what_goes_wrong_is_told_in_words(body: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        parse_rollout({"agent": "mini-swe-agent", "prompt": "p", **body})
