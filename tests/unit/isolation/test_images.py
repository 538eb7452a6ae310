"""Container images (capture/isolation/images.py) and the suite's offline task set
(tests/fixtures/tasks/), against the real podman: the content hash moves with what a build reads
and nothing else, a second build is a cache hit, a failed build names its file and step, two
processes build an image once, and each task is real: its hidden tests fail in its fresh image
and pass once its solution is applied, under Debian's Python 3.11 and without node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from capture.isolation import images
from capture.isolation.podman import EngineMissing, engine_command, engine_env
from tests.support import task_images as tasks
from tests.support.paths import REPO


@pytest.fixture(scope="module")
def refs() -> dict[str, str]:
    return tasks.task_images()


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*engine_command(), *args],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_in(image: str, script: str, *mounts: tuple[Path, str]) -> subprocess.CompletedProcess[str]:
    """``script`` under bash in a fresh container of ``image``, each (host path, container path)
    mounted read-only."""
    volumes = [arg for host, inside in mounts for arg in ("-v", f"{host}:{inside}:ro")]
    return podman("run", "--rm", *images.ulimit_args(), *volumes, image, "bash", "-c", script)


def context(folder: Path, containerfile: str, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Containerfile").write_text(containerfile)
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


# ---------------------------------------------------------------- the hash (pure)


def test_context_hash_moves_with_what_a_build_reads_and_nothing_else(tmp_path: Path) -> None:
    ctx = context(tmp_path / "a", "FROM localhost/x:y\nCOPY . /app\n", {"src/m.py": "x = 1\n"})
    file = ctx / "Containerfile"
    bases: dict[str, str | None] = {"localhost/x:y": "sha256:aaa"}

    def h(args: dict[str, str] | None = None, ids: dict[str, str | None] = bases) -> str:
        return images.context_hash(ctx, file, args, ids)

    first = h()
    assert len(first) == 12 and int(first, 16) >= 0
    assert h() == first
    # Not read by a build: mtimes, and where the context lies.
    os.utime(ctx / "src" / "m.py", (1, 1))
    assert h() == first
    moved = shutil.copytree(ctx, tmp_path / "b")
    assert images.context_hash(moved, moved / "Containerfile", None, bases) == first

    (ctx / "src" / "m.py").write_text("x = 2\n")
    changed_bytes = h()
    assert changed_bytes != first
    (ctx / "src" / "m.py").chmod(0o755)
    changed_mode = h()
    assert changed_mode != changed_bytes
    (ctx / "src" / "m.py").rename(ctx / "src" / "n.py")
    renamed = h()
    assert renamed != changed_mode
    (ctx / "empty").mkdir()
    with_dir = h()
    assert with_dir != renamed
    assert h({"BASE": "one"}) != with_dir
    assert h({"BASE": "one"}) != h({"BASE": "two"})
    assert h(ids={"localhost/x:y": "sha256:bbb"}) != with_dir
    file.write_text("FROM localhost/x:y\nCOPY . /srv\n")
    assert h() != with_dir


def test_from_refs_resolves_args_and_skips_stages() -> None:
    text = "ARG BASE=localhost/agenttap-base:bookworm\nFROM ${BASE}\nRUN true\n"
    assert images.from_refs(text) == ["localhost/agenttap-base:bookworm"]
    assert images.from_refs(text, {"BASE": "localhost/b:1"}) == ["localhost/b:1"]
    staged = "FROM --platform=linux/amd64 localhost/tools:1 AS build\nFROM $OS\nFROM build\n"
    assert images.from_refs(staged, {"OS": "debian:12"}) == ["localhost/tools:1", "debian:12"]


def test_base_key_moves_with_its_inputs_not_package_order(tmp_path: Path) -> None:
    key = images.base_key("bookworm", ["python3", "git"], "deb x", "mmdebstrap 1.3.5")
    assert key == images.base_key("bookworm", ["git", "python3"], "deb x", "mmdebstrap 1.3.5")
    assert key != images.base_key("trixie", ["git", "python3"], "deb x", "mmdebstrap 1.3.5")
    assert key != images.base_key("bookworm", ["git"], "deb x", "mmdebstrap 1.3.5")
    assert key != images.base_key("bookworm", ["python3", "git"], "deb y", "mmdebstrap 1.3.5")
    assert key != images.base_key("bookworm", ["python3", "git"], "deb x", "mmdebstrap 1.4")
    apt = tmp_path / "etc" / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d" / "b.sources").write_text("URIs: b\n")
    (apt / "sources.list.d" / "a.list").write_text("deb a\n")
    (apt / "sources.list.d" / "c.list.disabled").write_text("deb c\n")
    assert images.apt_sources_text(tmp_path) == "# a.list\ndeb a\n# b.sources\nURIs: b\n"


# ---------------------------------------------------------------- errors that speak


def test_engine_missing_speaks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(EngineMissing, match="podman is not installed.*apt-get install podman"):
        images.build_image(context(tmp_path, "FROM scratch\n", {}))


def test_mmdebstrap_missing_speaks(monkeypatch: pytest.MonkeyPatch) -> None:
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "mmdebstrap" else which(name))
    with pytest.raises(images.MmdebstrapMissing, match="apt-get install mmdebstrap"):
        images.base_image()


def test_a_failed_build_names_its_file_and_step(refs: dict[str, str], tmp_path: Path) -> None:
    broken = context(
        tmp_path / "broken",
        f"FROM {refs['base']}\nRUN echo building\nRUN exit 3\nRUN echo never\n",
        {},
    )
    with pytest.raises(images.BuildFailed) as failed:
        images.build_image(broken)
    message = str(failed.value)
    assert str(broken / "Containerfile") in message
    assert 'building at STEP "RUN exit 3"' in message
    assert "RUN echo never" not in message


def test_a_missing_local_base_is_named(tmp_path: Path) -> None:
    ctx = context(tmp_path, "FROM localhost/agenttap-no-such-image:1\n", {})
    with pytest.raises(images.BuildFailed, match="agenttap-no-such-image:1.*base_image"):
        images.build_image(ctx)


# ---------------------------------------------------------------- the cache


def test_a_second_build_is_a_cache_hit(refs: dict[str, str]) -> None:
    environment = tasks.task_folder("swe-lru") / "environment"
    args = {"BASE": refs["base"]}
    ref = images.build_image(environment, build_args=args)
    assert ref == refs["swe-lru"] and images.image_exists(ref)
    before = images.built["build"]
    started = time.monotonic()
    again = images.build_image(environment, build_args=args)
    assert again == ref
    assert images.built["build"] == before, "the second build_image ran podman build"
    assert time.monotonic() - started < 2.0
    assert images.planned_ref(environment, build_args=args) == ref


def test_a_rebuilt_base_changes_the_tag(refs: dict[str, str], tmp_path: Path) -> None:
    alias = f"localhost/agenttap-test-alias:{uuid.uuid4().hex[:8]}"
    ctx = context(tmp_path, f"FROM {alias}\nRUN true\n", {})
    assert podman("tag", refs["base"], alias).returncode == 0
    try:
        on_base = images.planned_ref(ctx)
        assert podman("tag", refs["swe-lru"], alias).returncode == 0
        assert images.planned_ref(ctx) != on_base
    finally:
        podman("untag", refs["swe-lru"], alias)
        podman("untag", refs["base"], alias)


def test_two_processes_build_an_image_once(refs: dict[str, str], tmp_path: Path) -> None:
    # Content of its own, so the build is not cached yet; removed after.
    ctx = context(
        tmp_path,
        f"FROM {refs['base']}\nCOPY marker /marker\nRUN sleep 1 && cat /marker\n",
        {"marker": uuid.uuid4().hex},
    )
    script = (
        "import json, sys; from capture.isolation import images; "
        "ref = images.build_image(sys.argv[1]); "
        "print(json.dumps([ref, images.built['build']]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(ctx)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    try:
        assert results[0][0] == results[1][0]
        assert sorted(count for _, count in results) == [0, 1]
    finally:
        podman("rmi", results[0][0])


# ---------------------------------------------------------------- the task set is real


def test_the_base_is_debians_python_311_without_node(refs: dict[str, str]) -> None:
    probe = run_in(
        refs["base"],
        "python3 -c 'import sys; print(sys.version_info[:2])'; python3 -m pytest --version; "
        "command -v node || echo no-node",
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.splitlines()[0] == "(3, 11)"
    assert "pytest" in probe.stdout + probe.stderr
    assert probe.stdout.strip().endswith("no-node")
    assert sys.version_info[:2] != (3, 11), "the image's Python should differ from the host's"
    alias = images.image_id(f"localhost/{images.BASE_NAME}:bookworm")
    assert alias is not None and alias == images.image_id(refs["base"])


@pytest.mark.parametrize("name", tasks.SWE_TASKS)
def test_swe_hidden_tests_fail_fresh_and_pass_solved(refs: dict[str, str], name: str) -> None:
    folder = tasks.task_folder(name)
    task = tasks.swe_task(name)
    assert task["id"] == name and len(task["prompt"]) > 40
    image = refs[name]
    assert images.image_workdir(image) == "/testbed" == task["workdir"]
    command = " ".join(tasks.SWE_TEST_COMMAND)
    assert command == task["test_command"]
    mounts = ((folder / "tests", "/tests"), (folder / "solution.patch", "/task/solution.patch"))

    clean = run_in(image, "git status --porcelain && git diff HEAD")
    assert clean.returncode == 0 and clean.stdout == "", clean.stdout + clean.stderr
    fresh = run_in(image, command, *mounts)
    assert fresh.returncode == 1, fresh.stdout + fresh.stderr
    assert " failed" in fresh.stdout
    assert not (folder / "environment" / "testbed" / "tests").exists()
    hidden = run_in(image, "ls /testbed; test ! -e /tests && echo no-tests-in-image")
    assert hidden.stdout.strip().endswith("no-tests-in-image")

    solve = "git apply /task/solution.patch && ! git diff HEAD --quiet"
    solved = run_in(image, f"{solve} && {command}", *mounts)
    assert solved.returncode == 0, solved.stdout + solved.stderr
    assert " passed" in solved.stdout and "failed" not in solved.stdout
    assert "3.11" in run_in(image, "python3 --version").stdout


@pytest.mark.parametrize("name", tasks.HARBOR_TASKS)
def test_harbor_task_rewards_zero_unsolved_and_one_solved(refs: dict[str, str], name: str) -> None:
    folder = tasks.task_folder(name)
    config = tomllib.loads((folder / "task.toml").read_text())
    environment = config["environment"]
    assert {"cpus", "memory_mb", "storage_mb", "build_timeout_sec"} <= environment.keys()
    assert config["agent"]["timeout_sec"] > 0 and config["verifier"]["timeout_sec"] > 0
    assert (folder / "instruction.md").read_text().strip()
    dockerfile = (folder / "environment" / "Dockerfile").read_text()
    assert "FROM localhost/agenttap-base:bookworm" in dockerfile
    image = refs[name]
    assert images.image_workdir(image) == "/app"
    mounts = ((folder / "tests", "/tests"), (folder / "solution", "/solution"))
    reward = "cat /logs/verifier/reward.txt"
    unsolved = run_in(image, f"bash /tests/test.sh && {reward}", *mounts)
    assert unsolved.stdout.strip() == "0", unsolved.stderr
    solved = run_in(image, f"bash /solution/solve.sh && bash /tests/test.sh && {reward}", *mounts)
    assert solved.stdout.strip() == "1", solved.stderr
