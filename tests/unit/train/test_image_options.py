"""The trainer adapters hand a task's image and a Harbor task folder through to POST /rollouts
(TRL's rollout function, verl's agent loop), only when given; TRL's names the step its
rollouts train."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from capture.train.trl import AgentTapRolloutFunc
from tests.support.paths import REPO


def test_trl_passes_an_image_and_a_task_folder_only_when_given() -> None:
    plain = AgentTapRolloutFunc(None, agent="mini-swe-agent")  # type: ignore[arg-type]
    assert "image" not in plain._options("t", 0) and "task" not in plain._options("t", 0)
    func = AgentTapRolloutFunc(
        None,  # type: ignore[arg-type]
        agent="mini-swe-agent",
        image=lambda task: f"localhost/{task}:1",
        task_folder="/tasks/h",
    )
    options: dict[str, Any] = func._options("swe", 3)
    assert options["image"] == "localhost/swe:1" and options["task"] == "/tasks/h"


def test_verl_passes_an_image_and_a_task_folder_per_sample_or_by_default(tmp_path: Path) -> None:
    script = (
        "import json\n"
        "from capture.train.verl import AgentTapAgentLoop as L\n"
        "loop = object.__new__(L)\n"
        "loop.defaults = {'agent': 'mini-swe-agent', 'workdir': None, 'verifier': None,\n"
        "                 'limits': None, 'timeout_s': None, 'image': 'localhost/a:1',\n"
        f"                 'task': None}}\n"
        "one = loop.rollout_body(raw_prompt='p')\n"
        f"two = loop.rollout_body(raw_prompt='p', extra_info={{'agenttap': {{'task': '{tmp_path}'}}}})\n"
        "print(json.dumps([one, two]))\n"
    )
    done = subprocess.run(
        [str(REPO / ".venv-train" / "bin" / "python"), "-c", script],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    one, two = json.loads(done.stdout)
    assert one["image"] == "localhost/a:1" and "task" not in one
    assert two["task"] == str(tmp_path) and two["image"] == "localhost/a:1"


def test_trl_names_the_step_its_rollouts_train_as_the_trainer_numbers_it() -> None:
    """TRL's ``global_step`` counts the steps done (0 while the first step's rollouts run); the
    console, ``report_to`` and the viewer's steps are 1, 2, ...: ``trainer_step`` is the step
    the rollouts train. Given metadata wins."""
    func = AgentTapRolloutFunc(None, agent="mini-swe-agent")  # type: ignore[arg-type]
    assert func._options("t", 0)["metadata"]["trainer_step"] == 1
    assert func._options("t", 9)["metadata"]["trainer_step"] == 10
    assert "trainer_step" not in func._options("t", None)["metadata"]
    given = AgentTapRolloutFunc(
        None,  # type: ignore[arg-type]
        agent="mini-swe-agent",
        metadata={"trainer_step": "warm-up"},
    )
    assert given._options("t", 0)["metadata"]["trainer_step"] == "warm-up"
