"""The scaffolds beside mini-swe-agent in a task's own image: Claude Code, OpenCode, Codex,
Gemini CLI, OpenHands and Terminus-2, each brought in from the host (its binary, or node or its
venv's Python and its script, through the host's loader; Terminus-2's tmux too),
fix swe-slugify inside the image's container, their tool calls run by the image's own tools in
/testbed; the verifier scores the state each left with the task's hidden tests, as
tests/e2e/rollouts/test_rollouts_images.py does for mini-swe-agent. And a host program reached
through a linked folder (a worktree's .venv or .cache linked to another checkout's) runs there."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.client.launcher import AgentTap
from capture.isolation.containers import host_program
from capture.isolation.podman import engine_command, engine_env
from tests.e2e.clis.test_gemini_cli import answer_router
from tests.e2e.providers.test_anthropic_sdk_stub import hermes
from tests.e2e.providers.test_conservation_e2e import conservation
from tests.e2e.rollouts.test_rollouts_images import GRADE, HIDDEN, TASK, containers_of
from tests.support.proxies import read_threads, read_turns
from tests.support.scaffold_task import TITLE, TITLE_PROMPT, check_trained_exactly_once
from tests.support.stub_vllm import StubPolicy
from tests.support.task_images import task_image

# The prompt's last sentence: OpenCode sends the prompt quoted, its quotes escaped.
ASKED = TASK["prompt"].rsplit(": ", 1)[-1]
SLUG = "/testbed/textkit/slug.py"
# The one-character fix: every run of other characters is one separator.
OLD, NEW = '[^a-zA-Z0-9]"', '[^a-zA-Z0-9]+"'
# The repository's package as the image's Python imports it: /testbed is only in the image.
PROBE = "python3 -c 'import sys, textkit; print(textkit.__file__, sys.version.split()[0])'"
SEEN = "/testbed/textkit/__init__.py 3.11"
SED = "sed -i 's/9]\"/9]+\"/' textkit/slug.py"


def _terminus(plan: str, keystrokes: str | None, complete: bool = False) -> str:
    """One Terminus-2 answer: its keystrokes typed into its tmux session in the container."""
    commands = [] if keystrokes is None else [{"keystrokes": keystrokes, "duration": 0.5}]
    answer = {"analysis": plan, "plan": plan, "commands": commands, "task_complete": complete}
    return json.dumps(answer, indent=2)


def _codex(command: str) -> str:
    script = f"const r = await tools.exec_command({{cmd: {command!r}}});\ntext(r.output);"
    return "<think>\nRun it.\n</think>\n\n" + hermes("exec", {"input": script})


# Each scaffold's own tools: look, run the image's Python, fix the file, finish.
STEPS = {
    "claude-code": [
        "Look first.\n" + hermes("Read", {"file_path": SLUG}),
        # Its Grep runs its built-in ripgrep: itself again, by process.execPath.
        hermes("Grep", {"pattern": "re\\.sub", "path": "/testbed"}),
        hermes("Bash", {"command": PROBE, "description": "Which Python"}),
        # In the order Claude Code renders its Edit call back (replace_all first), so the
        # next prompt extends the tokens sampled.
        hermes(
            "Edit", {"replace_all": False, "file_path": SLUG, "old_string": OLD, "new_string": NEW}
        ),
        "Fixed slugify.",
    ],
    # OpenCode's read and edit resolve a relative path in its working folder.
    "opencode": [
        "Look first.\n" + hermes("read", {"filePath": "textkit/slug.py"}),
        hermes("bash", {"command": PROBE, "description": "Which Python"}),
        hermes("edit", {"filePath": "textkit/slug.py", "oldString": OLD, "newString": NEW}),
        "Fixed slugify.",
    ],
    # Codex's one tool is exec, a script calling its nested tools.
    "codex": [_codex(PROBE), _codex(SED), "Fixed slugify."],
    "gemini": [
        hermes("read_file", {"file_path": SLUG}),
        hermes("run_shell_command", {"command": PROBE, "description": "Which Python"}),
        hermes("run_shell_command", {"command": SED, "description": "Fix the run"}),
        "Fixed slugify.",
    ],
    # OpenHands' file editor wants absolute paths; its terminal runs in /testbed.
    "openhands": [
        "Look first.\n"
        + hermes("file_editor", {"command": "view", "path": SLUG, "security_risk": "LOW"}),
        hermes("terminal", {"command": PROBE, "security_risk": "LOW"}),
        hermes("terminal", {"command": SED, "security_risk": "LOW"}),
        hermes("finish", {"message": "Fixed slugify."}),
    ],
    # Terminus-2 answers in JSON: keystrokes into tmux (the host's, brought in: the image has
    # none), then done, then done again when asked to confirm.
    "terminus-2": [
        _terminus("Which Python.", PROBE + "\n"),
        _terminus("Fix the run.", SED + "\n"),
        _terminus("Fixed.", None, complete=True),
        _terminus("Yes, fixed.", None, complete=True),
    ],
}


@pytest.fixture(scope="module")
def image() -> str:
    return task_image("swe-slugify")


def _rule(stub: StubPolicy, steps: list[str]) -> Callable[[dict[str, Any]], str | None]:
    def rule(body: dict[str, Any]) -> str | None:
        routed = answer_router(body)  # Gemini CLI's router call
        if routed is not None:
            return routed
        text = stub.tok.decode(body["prompt"])
        if ASKED not in text:
            return None
        if TITLE_PROMPT in text:
            return TITLE
        done = text.count("<tool_response>")
        if steps[0].startswith("{"):  # Terminus-2: no tool calls, one answer per step
            done = text.count("<|im_start|>assistant") - 1
        return steps[min(done, len(steps) - 1)]

    return rule


@pytest.fixture
def scripted(stub: StubPolicy, request: pytest.FixtureRequest) -> Iterator[None]:
    rule = _rule(stub, STEPS[request.node.callspec.params["agent"]])
    stub.rules.insert(0, rule)
    yield
    stub.rules.remove(rule)


@pytest.mark.parametrize("agent", list(STEPS))
@pytest.mark.usefixtures("scripted")
def test_each_scaffold_fixes_a_swe_task_in_its_image(
    stub_tap: AgentTap, stub: StubPolicy, image: str, agent: str
) -> None:
    verifier = {"command": GRADE, "tests": HIDDEN}
    result = stub_tap.rollout(agent, TASK["prompt"], image=image, verifier=verifier)
    assert result["status"] == "done" and result["sandbox"] == "podman", result
    run = result["rollouts"][0]
    assert run["status"] == "ok", (run["error"], run.get("agent_output"))
    assert run["reward"] == 1.0 and run["finish_reason"] == "stop", run["verifier_stderr"]
    folder = Path(run["workdir"]).parent
    assert '9]+"' in (folder / "work" / "textkit" / "slug.py").read_text()
    sid = run["session_id"]
    turns = read_turns(stub_tap.out, sid)
    # Its tool call ran in the image: the image's Python imported the package in /testbed.
    assert SEEN in stub.tok.decode(turns[-1]["prompt_ids"])
    if agent == "terminus-2":  # the image has no tmux: the one it typed into was the host's
        found = subprocess.run(
            [*engine_command(), "run", "--rm", "--network", "none", image, "sh", "-c",
             "command -v tmux"],
            capture_output=True, text=True, env=engine_env(), timeout=120, check=False,
        )  # fmt: skip
        assert found.returncode != 0 and not found.stdout.strip(), found
    if agent == "claude-code":  # its ripgrep found the file, in the image
        assert "textkit/slug.py" in stub.tok.decode(turns[2]["prompt_ids"]).split("Grep")[-1]
    rows = read_threads(stub_tap.out, sid)
    conservation(rows, turns)
    # A schema-constrained call (Gemini CLI's router) trains re-scored logprobs (provenance 2,
    # docs/SHARDS.md); every other call the stub's own, sampled.
    constrained = {t["request_id"] for t in turns if "constrained" in t["metadata"]}
    check_trained_exactly_once(
        [r for r in rows if not constrained & set(r["trained_request_ids"])],
        [t for t in turns if t["request_id"] not in constrained],
    )
    # One conversation, a call per step (OpenCode's title call, Gemini CLI's router call their
    # one side row).
    mains = [r for r in rows if r["thread_kind"] == "main"]
    assert [r["num_turns"] for r in mains] == [len(STEPS[agent])], rows
    assert containers_of(result["id"]) == []  # every container went with its run


def test_a_host_program_reached_through_a_linked_folder_runs_in_the_image(
    image: str, tmp_path: Path
) -> None:
    """Only real paths are shown in the container: a script called through a linked folder is
    run by its real path, its interpreter brought in from the host."""
    bin_folder = tmp_path / "real" / "bin"
    bin_folder.mkdir(parents=True)
    tool = bin_folder / "tool"
    tool.write_text("#!/usr/bin/env python3\nimport sys\nprint('ran', sys.argv[1])\n")
    tool.chmod(0o755)
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    argv, binds = host_program([str(tmp_path / "linked" / "bin" / "tool"), "here"], "/usr/bin")
    assert str(tmp_path / "linked") not in " ".join(argv)
    ran = subprocess.run(
        [*engine_command(), "run", "--rm", "--network", "none",
         *(f"--volume={b.flag()}" for b in binds), "--entrypoint", "[]", image, *argv],
        capture_output=True, text=True, env=engine_env(), timeout=120, check=False,
    )  # fmt: skip
    assert ran.stdout.strip() == "ran here", ran.stderr
