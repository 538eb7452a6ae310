"""Every Python snippet of README.md and docs/*.md runs as printed: each is run whole, in a
subprocess of its own (``python -c`` with the block's text), with only the environment a user has
after ``scripts/run_proxy.sh`` printed its banner (``POLICY_URL``, ``AGENTTAP_TOKENIZER``). The
policy is the scripted stub; the trainer snippet drives the real Claude Code, which writes
hello.txt and finishes. The reading snippets then read, in the same folder, what it wrote."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.storage.reader import load_threads
from tests.e2e.rollouts.test_rollouts import FIRST_CALL, agent_rule
from tests.e2e.rollouts.test_rollouts_images import harbor_rule
from tests.support.paths import QWEN3, REPO
from tests.support.stub_vllm import StubPolicy

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def kind(code: str) -> str:
    """Which test runs a snippet, by what it starts."""
    if "pool.rollout(" in code:
        return "ray-rollouts"
    if "ProxyPool.start(" in code:
        return "ray"
    if "task=" in code or "image=" in code:
        return "task"
    if "capture.isolation.images" in code:
        return "images"
    if "AgentTap.start(" in code:
        return "trainer"
    if "load_threads(" in code:
        return "reader"
    return "unknown"


SNIPPETS = [(f"{p.relative_to(REPO)}#{i}", code) for p in DOCS for i, code in
            enumerate(python_blocks(p), 1)]  # fmt: skip


def only(which: str) -> list[tuple[str, str]]:
    return [(name, code) for name, code in SNIPPETS if kind(code) == which]


def run_snippet(
    code: str, cwd: Path, timeout: float, **env: str
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AGENTTAP_"))}
    base.pop("POLICY_URL", None)
    base.pop("POLICY_URLS", None)
    home = cwd / "home"  # Claude Code's config and mitmproxy's CA (~/.mitmproxy): fresh ones
    home.mkdir(exist_ok=True)
    full = {
        **base,
        "HOME": str(home),
        "PYTHONPATH": str(REPO),
        "AGENTTAP_TOKENIZER": str(QWEN3),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=full, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def count(pattern: str, done: subprocess.CompletedProcess[str]) -> int:
    found = re.search(pattern, done.stdout, re.M)
    assert found, f"no {pattern!r} in its output:\n{done.stdout}\n{done.stderr[-3000:]}"
    return int(found.group(1))


def test_every_snippet_is_one_a_test_here_runs() -> None:
    kinds = [kind(code) for _, code in SNIPPETS]
    assert "unknown" not in kinds, [n for n, c in SNIPPETS if kind(c) == "unknown"]
    assert kinds.count("trainer") == 1 and kinds.count("ray") == 1
    assert kinds.count("ray-rollouts") == 1
    assert kinds.count("reader") >= 2  # README's Output section and docs/SHARDS.md
    # Where their output goes: the one folder the trainer writes and the readers read.
    (trainer,) = [code for _, code in only("trainer")]
    assert 'out="rollouts"' in trainer
    for name, code in only("reader"):
        assert '"rollouts"' in code, f"{name} reads another folder than the trainer writes"


def test_the_trainer_snippet_then_the_reading_snippets(stub: StubPolicy, tmp_path: Path) -> None:
    # Claude Code's first call writes hello.txt through Bash; once the tool's result is in the
    # prompt it answers "Done." and exits.
    rule = agent_rule(stub, FIRST_CALL["claude-code"])
    stub.rules.insert(0, rule)
    try:
        ((name, code),) = only("trainer")
        done = run_snippet(code, tmp_path, 300, POLICY_URL=stub.url)
    finally:
        stub.rules.remove(rule)
    assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr[-5000:]}"
    assert (tmp_path / "hello-task" / "hello.txt").read_text() == "hi"
    assert count(r"^(\d+) rows$", done) >= 1
    rows = load_threads(tmp_path / "rollouts")
    main = max(rows, key=lambda r: r["num_turns"])
    assert main["num_turns"] >= 2 and main["reward"] == 0.5  # the late reward, joined

    for name, code in only("reader"):
        done = run_snippet(code, tmp_path, 120)
        assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr[-5000:]}"
        assert count(r"(\d+) rows", done) >= 1, name


@pytest.fixture
def second_stub() -> Iterator[StubPolicy]:
    policy = StubPolicy(str(QWEN3))
    policy.start()
    yield policy
    policy.stop()


def test_the_ray_snippet(stub: StubPolicy, second_stub: StubPolicy, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    ((name, code),) = only("ray")
    urls = f"{stub.url},{second_stub.url}"
    done = run_snippet(code, tmp_path, 180, POLICY_URLS=urls)
    assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr[-5000:]}"
    rows, through_ray = (
        count(r"(\d+) rows,", done),
        count(r"(\d+) through Ray Data", done),
    )
    assert rows == through_ray == 1  # one session, one call: one thread row
    shards = sorted((tmp_path / "rollouts-pool").glob("proxy-*/threads/*.parquet"))
    assert len(shards) == 1, shards


def test_the_ray_rollouts_snippet(stub: StubPolicy, tmp_path: Path) -> None:
    """docs/API.md "Rollouts on Ray": real Claude Code agents run by the pool's actors, the
    seed folder shipped to them, scored by the verifier, read back as one dataset."""
    pytest.importorskip("ray")
    ((name, code),) = only("ray-rollouts")
    rule = agent_rule(stub, FIRST_CALL["claude-code"])
    stub.rules.insert(0, rule)
    try:
        done = run_snippet(code, tmp_path, 300, POLICY_URLS=stub.url)
    finally:
        stub.rules.remove(rule)
    assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr[-5000:]}"
    runs = re.findall(r"^(\S+-\d) (\w+) (\d+) (\w+) ([\d.]+|None)$", done.stdout, re.M)
    assert len(runs) == 2, done.stdout
    assert {(finish, reward) for _, _, _, finish, reward in runs} == {("stop", "1.0")}, runs
    assert count(r"^(\d+) rows$", done) >= 2
    assert count(r"^(\d+) folders of logs$", done) >= 1
    logs = list((tmp_path / "files").glob("proxy-*/*/*/agent.log"))
    assert len(logs) == 2, logs


def test_the_image_snippets_and_the_task_snippet(stub: StubPolicy, tmp_path: Path) -> None:
    """Building a base and task images (docs/IMAGES.md), then README's Harbor task folder to a
    scored group: the scripted mini-swe-agent fixes it in its image, its test script gives 1.
    Run where a user runs them, the repository's folder: its tests/ is linked in."""
    (tmp_path / "tests").symlink_to(REPO / "tests")
    for name, code in only("images"):
        done = run_snippet(code, tmp_path, 600)
        assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr[-5000:]}"
    rule = harbor_rule(stub)
    stub.rules.insert(0, rule)
    try:
        ((name, code),) = only("task")
        done = run_snippet(code, tmp_path, 600, POLICY_URL=stub.url)
    finally:
        stub.rules.remove(rule)
    assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr[-5000:]}"
    assert done.stdout.strip().splitlines()[-1] == "[('ok', 1.0), ('ok', 1.0)]", done.stdout
