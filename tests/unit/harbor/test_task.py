"""capture/harbor/task.py: a Harbor task folder read into a ``HarborTask`` (every field), each
way a folder can be wrong refused in words naming the file, the memory forms Harbor accepts,
links leaving the folder refused, the build context's hash, and the limits mapping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capture.harbor import task as T
from capture.harbor.task import HarborTask, context_hash, limits, read_task, task_hash
from capture.isolation.limits import SANDBOX_LIMIT_KEYS, SandboxLimits, parse_sandbox_limits

FULL_TOML = """\
version = "1.0"

[task]
name = "acme/fix-the-build"

[metadata]
difficulty = "easy"
tags = ["build", "c"]

[environment]
cpus = 2
memory_mb = 4096
storage_mb = 10240
build_timeout_sec = 900.0
workdir = "/app"
network_mode = "no-network"
gpus = 0

[agent]
timeout_sec = 1200
user = "agent"

[verifier]
timeout_sec = 300.0
env = { MODE = "strict" }

[somebody_elses_table]
x = 1
"""


def make_task(root: Path, toml: str = FULL_TOML, *, solution: bool = True) -> Path:
    """A complete Harbor task folder under ``root``."""
    folder = root / "task"
    (folder / "environment" / "src").mkdir(parents=True)
    (folder / "tests").mkdir()
    (folder / "task.toml").write_text(toml)
    (folder / "instruction.md").write_text(
        "<!-- BENCHMARK DATA canary GUID 1234 -->\n\nFix the build in /app.\n"
    )
    (folder / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nCOPY src /app\n")
    (folder / "environment" / "src" / "main.c").write_text("int main(void) { return 1; }\n")
    (folder / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    os.chmod(folder / "tests" / "test.sh", 0o755)
    if solution:
        (folder / "solution").mkdir()
        (folder / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    return folder


def test_a_full_task_is_read_field_by_field(tmp_path: Path) -> None:
    folder = make_task(tmp_path)
    (folder / "tests" / "Dockerfile").write_text("FROM python:3.12\n")
    task = read_task(folder)
    root = folder.resolve()
    assert task == HarborTask(
        folder=root,
        name="acme/fix-the-build",
        prompt="Fix the build in /app.\n",  # Harbor's canary line and the blank after it gone
        environment=root / "environment",
        containerfile=root / "environment" / "Dockerfile",
        tests=root / "tests",
        test_script=root / "tests" / "test.sh",
        verifier_containerfile=root / "tests" / "Dockerfile",
        verifier_separate=False,
        solution=root / "solution",
        cpus=2.0,
        memory_mb=4096,
        storage_mb=10240,
        build_timeout_s=900.0,
        agent_timeout_s=1200.0,
        verifier_timeout_s=300.0,
        docker_image=None,
        workdir="/app",
        network_mode="no-network",
        allowed_hosts=(),
        metadata={"difficulty": "easy", "tags": ["build", "c"]},
        # Set, and acted on by nothing here: listed, not silently dropped.
        unread=("agent.user", "environment.gpus", "somebody_elses_table", "verifier.env"),
    )


def test_a_minimal_task_leaves_unset_numbers_none_and_takes_harbors_defaults(
    tmp_path: Path,
) -> None:
    folder = make_task(tmp_path, "", solution=False)
    os.rename(folder / "environment" / "Dockerfile", folder / "environment" / "Containerfile")
    task = read_task(folder)
    assert task.name == "task"  # the folder's name, as Harbor names it without [task]
    assert task.containerfile.name == "Containerfile"
    assert (task.cpus, task.memory_mb, task.storage_mb) == (None, None, None)
    assert (task.build_timeout_s, task.agent_timeout_s, task.verifier_timeout_s) == (
        None,
        None,
        None,
    )
    assert task.solution is None and task.verifier_containerfile is None
    assert task.network_mode == T.HARBOR_NETWORK_MODE == "public"
    assert task.metadata is None and task.unread == ()


@pytest.mark.parametrize(
    ("remove", "words"),
    [
        ("task.toml", "task.toml (the task's configuration) is missing"),
        ("instruction.md", "instruction.md (the agent's prompt) is missing"),
        ("environment/Dockerfile", "has no environment/Dockerfile (nor environment/Containerfile)"),
        ("environment", "has no environment/ folder"),
        ("tests/test.sh", "tests/test.sh (the verifier's script) is missing"),
        ("tests", "tests/test.sh (the verifier's script) is missing"),
    ],
)
def test_each_missing_file_is_named(tmp_path: Path, remove: str, words: str) -> None:
    folder = make_task(tmp_path)
    path = folder / remove
    if path.is_dir():
        for child in sorted(path.rglob("*"), reverse=True):
            child.rmdir() if child.is_dir() else child.unlink()
        path.rmdir()
    else:
        path.unlink()
    with pytest.raises(ValueError, match="add ") as caught:
        read_task(folder)
    assert words in str(caught.value)


def test_a_missing_or_plain_file_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_task(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        read_task(tmp_path / "file")


def test_a_required_file_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    folder = make_task(tmp_path)
    (folder / "instruction.md").unlink()
    (folder / "instruction.md").mkdir()
    with pytest.raises(ValueError, match=r"instruction\.md \(the agent's prompt\) is not a file"):
        read_task(folder)


def test_a_docker_image_without_a_dockerfile_says_to_add_one(tmp_path: Path) -> None:
    folder = make_task(tmp_path, '[environment]\ndocker_image = "ghcr.io/acme/img:1"\n')
    (folder / "environment" / "Dockerfile").unlink()
    with pytest.raises(ValueError, match="ghcr.io/acme/img:1.*FROM it"):
        read_task(folder)
    (folder / "environment" / "Dockerfile").write_text("FROM ghcr.io/acme/img:1\n")
    assert read_task(folder).docker_image == "ghcr.io/acme/img:1"


def test_bad_toml_is_refused_naming_the_file(tmp_path: Path) -> None:
    folder = make_task(tmp_path, "[environment\ncpus = 2\n")
    with pytest.raises(ValueError, match=r"task\.toml is not valid TOML .*fix its syntax"):
        read_task(folder)


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ("[environment]\ncpus = 0\n", r"\[environment\] cpus must be above zero, not 0"),
        ("[environment]\ncpus = -1.5\n", r"cpus must be above zero, not -1.5"),
        ("[environment]\ncpus = nan\n", r"cpus must be above zero, not nan"),
        ('[environment]\ncpus = "2"\n', r"cpus must be a number, not a string"),
        ("[environment]\ncpus = true\n", r"cpus must be a number, not true/false"),
        ("[environment]\nmemory_mb = 0\n", r"memory_mb must be above zero, not 0"),
        ("[environment]\nmemory_mb = 1.5\n", r"memory_mb must be a whole number of MB"),
        ("[environment]\nstorage_mb = -10\n", r"storage_mb must be above zero, not -10"),
        ("[environment]\nbuild_timeout_sec = 0\n", r"build_timeout_sec must be above zero"),
        ("[agent]\ntimeout_sec = -1\n", r"\[agent\] timeout_sec must be above zero"),
        ('[verifier]\ntimeout_sec = "600"\n', r"\[verifier\] timeout_sec must be a number"),
        ('environment = "big"\n', r"environment must be a table"),
        ("[task]\nname = 3\n", r"\[task\] name must be a string, not an integer"),
        ('metadata = "x"\n', r"metadata must be a table, not a string"),
        ('[environment]\nnetwork_mode = "lan"\n', r"network_mode = 'lan' is not one of"),
        (
            '[environment]\nallowed_hosts = ["a.com"]\n',
            r'allowed_hosts needs network_mode = "allowlist"',
        ),
        ('[verifier]\nenvironment_mode = "both"\n', r"environment_mode = 'both'"),
        ("[[steps]]\nname = 'one'\n", r"multi-step task"),
        ('[environment]\nos = "windows"\n', r"Linux images only"),
    ],
)
def test_wrong_types_and_numbers_are_refused(tmp_path: Path, toml: str, words: str) -> None:
    folder = make_task(tmp_path, toml)
    with pytest.raises(ValueError, match=words) as caught:
        read_task(folder)
    assert str(folder.resolve() / "task.toml") in str(caught.value)


@pytest.mark.parametrize(
    ("environment", "memory_mb"),
    [
        ("memory_mb = 2048", 2048),
        ("memory_mb = 2048.0", 2048),  # an integral float, as pydantic's int takes it
        ('memory = "2G"', 2048),
        ('memory = "1.5g"', 1536),
        ('memory = " 512M "', 512),
        ('memory = "1048576K"', 1024),
        ('memory = "4G"\nmemory_mb = 4096', 4096),  # both, agreeing
    ],
)
def test_memory_in_each_form_harbor_accepts(
    tmp_path: Path, environment: str, memory_mb: int
) -> None:
    folder = make_task(tmp_path, f"[environment]\n{environment}\n")
    assert read_task(folder).memory_mb == memory_mb


def test_storage_takes_the_same_string_form(tmp_path: Path) -> None:
    folder = make_task(tmp_path, '[environment]\nstorage = "10G"\n')
    assert read_task(folder).storage_mb == 10240


@pytest.mark.parametrize(
    ("environment", "words"),
    [
        ('memory = "2GB"', r"memory = '2GB' is not a size like"),
        ('memory = "2Gi"', r"is not a size like"),
        ('memory = "-1G"', r"is not a size like"),
        ('memory = "512K"', r"memory = '512K' is under 1 MB"),
        ("memory = 2048", r"memory must be a size string .* or give memory_mb = <MB>"),
        ('memory = "2G"\nmemory_mb = 1024', r"\(2048 MB\) and memory_mb = 1024 disagree"),
    ],
)
def test_memory_forms_harbor_refuses_or_drops_are_refused(
    tmp_path: Path, environment: str, words: str
) -> None:
    folder = make_task(tmp_path, f"[environment]\n{environment}\n")
    with pytest.raises(ValueError, match=words):
        read_task(folder)


def test_network_and_verifier_modes(tmp_path: Path) -> None:
    toml = (
        '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n'
        '[verifier.environment]\ndocker_image = "python:3.12"\n'
    )
    task = read_task(make_task(tmp_path, toml))
    assert task.network_mode == "allowlist" and task.allowed_hosts == ("pypi.org",)
    # [verifier.environment] alone makes the verifier separate (Harbor's verifier_mode.py);
    # what it sets is not acted on, and says so.
    assert task.verifier_separate is True
    assert task.unread == ("verifier.environment.docker_image",)


def test_deprecated_allow_internet_counts_only_without_network_mode(tmp_path: Path) -> None:
    assert read_task(make_task(tmp_path / "a", "[environment]\nallow_internet = false\n")).network_mode == "no-network"  # fmt: skip
    both = '[environment]\nallow_internet = false\nnetwork_mode = "public"\n'
    assert read_task(make_task(tmp_path / "b", both)).network_mode == "public"


def test_shared_verifier_with_its_own_environment_is_refused(tmp_path: Path) -> None:
    toml = '[verifier]\nenvironment_mode = "shared"\n[verifier.environment]\ncpus = 1\n'
    with pytest.raises(ValueError, match=r'"shared" cannot have \[verifier.environment\]'):
        read_task(make_task(tmp_path, toml))


def test_a_compose_file_is_refused(tmp_path: Path) -> None:
    folder = make_task(tmp_path)
    (folder / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(ValueError, match=r"docker-compose\.yaml describes several containers"):
        read_task(folder)


@pytest.mark.parametrize(
    "where",
    ["environment/src/passwd", "instruction.md", "tests/helper", "solution", "extra/deep/link"],
)
def test_a_link_leaving_the_folder_is_refused(tmp_path: Path, where: str) -> None:
    folder = make_task(tmp_path)
    (tmp_path / "outside").write_text("the host's secret\n")
    link = folder / where
    if link.exists():
        link.unlink() if link.is_file() else None
        if link.is_dir():
            for child in link.iterdir():
                child.unlink()
            link.rmdir()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(tmp_path / "outside")
    with pytest.raises(ValueError, match=r"is a link to .*outside the task's folder"):
        read_task(folder)


def test_a_relative_link_climbing_out_is_refused(tmp_path: Path) -> None:
    folder = make_task(tmp_path)
    (folder / "environment" / "up").symlink_to("../../..")
    with pytest.raises(ValueError, match="outside the task's folder"):
        read_task(folder)


def test_links_inside_the_folder_are_kept(tmp_path: Path) -> None:
    folder = make_task(tmp_path)
    (folder / "environment" / "same.c").symlink_to("src/main.c")
    (folder / "tests" / "env").symlink_to("../environment")
    assert read_task(folder).environment == folder.resolve() / "environment"


def test_a_link_loop_and_a_fifo_are_refused(tmp_path: Path) -> None:
    folder = make_task(tmp_path / "loop")
    (folder / "environment" / "a").symlink_to("b")
    (folder / "environment" / "b").symlink_to("a")
    with pytest.raises(ValueError, match="loop"):
        read_task(folder)
    folder = make_task(tmp_path / "fifo")
    os.mkfifo(folder / "environment" / "pipe")
    with pytest.raises(ValueError, match="device, FIFO or socket"):
        read_task(folder)


def test_the_hash_is_stable_and_changes_on_any_edit(tmp_path: Path) -> None:
    folder = make_task(tmp_path)
    task = read_task(folder)
    first = task_hash(task)
    assert len(first) == 64 and task_hash(read_task(folder)) == first
    main_c = folder / "environment" / "src" / "main.c"

    # The same files elsewhere (another checkout, other times) hash the same.
    other = make_task(tmp_path / "elsewhere")
    os.utime(other / "environment" / "Dockerfile", (0, 0))
    assert task_hash(read_task(other)) == first

    body = main_c.read_bytes()
    main_c.write_bytes(body.replace(b"return 1", b"return 0"))  # one byte
    assert task_hash(task) != first
    main_c.write_bytes(body)
    assert task_hash(task) == first

    os.chmod(main_c, 0o755)
    assert task_hash(task) != first
    os.chmod(main_c, 0o644)
    assert task_hash(task) == first

    main_c.rename(main_c.with_name("main2.c"))
    assert task_hash(task) != first
    main_c.with_name("main2.c").rename(main_c)
    (folder / "environment" / "src" / "empty").mkdir()
    assert task_hash(task) != first
    (folder / "environment" / "src" / "empty").rmdir()
    assert task_hash(task) == first

    # Outside the build context: not the image's, not in its hash.
    (folder / "tests" / "test.sh").write_text("#!/bin/bash\nexit 1\n")
    (folder / "instruction.md").write_text("Another prompt.\n")
    assert task_hash(task) == first


def test_the_hash_tells_a_link_from_a_file_and_links_by_target(tmp_path: Path) -> None:
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "a").write_text("a")
    (context / "b").symlink_to("a")
    with_link = context_hash(context)
    (context / "b").unlink()
    (context / "b").symlink_to("./a")
    assert context_hash(context) != with_link
    (context / "b").unlink()
    (context / "b").write_text("a")
    assert context_hash(context) not in (with_link, context_hash(tmp_path / "nothing"))


def test_limits_map_onto_the_rollout_limit_keys(tmp_path: Path) -> None:
    task = read_task(make_task(tmp_path))
    mapped, unenforced = limits(task)
    assert mapped == {"memory_mb": 4096, "disk_mb": 10240}
    assert set(mapped) <= set(SANDBOX_LIMIT_KEYS)
    # What a rollout request would carry parses as agenttap's limits.
    parsed = parse_sandbox_limits(mapped, SandboxLimits())
    assert (parsed.memory_mb, parsed.disk_mb) == (4096, 10240)
    # cpus is no limit key: the container engine's --cpus (capture/rollouts/images.py).
    assert unenforced == []


def test_limits_of_a_task_that_asks_nothing(tmp_path: Path) -> None:
    assert limits(read_task(make_task(tmp_path, ""))) == ({}, [])


def test_the_verifier_paths_are_harbors() -> None:
    assert T.TESTS_DIR == "/tests" and T.TEST_SCRIPT == "/tests/test.sh"
    assert T.VERIFIER_LOGS == "/logs/verifier"
    assert T.REWARD_TXT == T.VERIFIER_LOGS + "/reward.txt"
    assert T.REWARD_JSON == T.VERIFIER_LOGS + "/reward.json"
    assert T.TEST_STDOUT == T.VERIFIER_LOGS + "/test-stdout.txt"
