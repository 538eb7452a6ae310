"""A Harbor task folder (``"task": DIR`` in ``POST /rollouts``) read into what a rollout needs:
``read_task`` gives a ``HarborTask`` (its prompt, its image's build context and Containerfile,
its tests, its resources and timeouts) or a ``ValueError`` worded for the API's caller;
``limits`` maps its resources onto a rollout's ``"limits"`` keys and names what agenttap does not
enforce; ``task_hash`` is a content hash of its build context, the image cache's key.

The format is Harbor's (PyPI ``harbor`` 0.26.0, the one scripts/setup_harbor.sh installs)::

    task.toml          [task] name, [metadata], [environment], [agent], [verifier]
    instruction.md     the agent's prompt
    environment/       the image's build context, with its Dockerfile (or Containerfile)
    tests/test.sh      the verifier, copied to /tests; tests/Dockerfile: a verifier image
    solution/          optional (Harbor's oracle agent runs solution/solve.sh)

The keys are read as ``harbor/models/task/config.py`` (``TaskConfig``, ``EnvironmentConfig``,
``AgentConfig``, ``VerifierConfig``) defines them; the files as ``harbor/models/task/paths.py``
(``TaskPaths``) and ``harbor/models/task/task.py`` (``Task``) find them. Like Harbor (pydantic's
default), a key or table it does not know is ignored, not refused; unlike Harbor, a number is a
TOML number (not a string), and none may be zero or negative. What Harbor runs and agenttap
cannot (several steps, a Windows image, a compose file's several containers, a pulled
``docker_image`` without a Dockerfile) is refused by name; what is read but not acted on is
listed in ``HarborTask.unread``.

Standard library only: capture/harbor may import nothing of the proxy (its ``MAY_IMPORT``).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Where Harbor's verifier puts and finds things inside the task's container: harbor 0.26.0,
# harbor/models/trial/paths.py ``EnvironmentPaths`` (the paths) and harbor/verifier/verifier.py
# ``Verifier.verify`` (the order). It copies tests/ to TESTS_DIR, removes both reward files,
# runs ``chmod +x`` on the script as root, then runs it directly (its shebang, not ``bash``)
# as ``(TEST_SCRIPT) > TEST_STDOUT 2>&1``; the reward is REWARD_JSON if it exists (a number or
# an object of numbers), else REWARD_TXT (one number), else the trial has no reward. There is
# no rewards.json in Harbor.
LOGS_DIR = "/logs"
AGENT_LOGS = "/logs/agent"
VERIFIER_LOGS = "/logs/verifier"
ARTIFACTS_DIR = "/logs/artifacts"
TESTS_DIR = "/tests"
TEST_SCRIPT = "/tests/test.sh"
TEST_STDOUT = "/logs/verifier/test-stdout.txt"
REWARD_TXT = "/logs/verifier/reward.txt"
REWARD_JSON = "/logs/verifier/reward.json"
SOLUTION_DIR = "/solution"

# Harbor's defaults where task.toml is silent (config.py): the fields below stay None then, so
# a caller can tell "the task said 600" from "the task said nothing".
HARBOR_BUILD_TIMEOUT_S = 600.0
HARBOR_VERIFIER_TIMEOUT_S = 600.0
HARBOR_NETWORK_MODE = "public"
NETWORK_MODES = ("no-network", "public", "allowlist")

CONTAINERFILES = ("Dockerfile", "Containerfile")
# A compose file means several containers (harbor/environments/definition.py); agenttap runs one.
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")

# The keys this module acts on; any other key set in a known table is listed in ``unread``.
_READ = {
    "environment": {
        "cpus", "memory_mb", "memory", "storage_mb", "storage", "build_timeout_sec",
        "docker_image", "os", "workdir", "network_mode", "allowed_hosts", "allow_internet",
    },
    "agent": {"timeout_sec"},
    "verifier": {"timeout_sec", "environment_mode", "environment"},
    "solution": set(),
}  # fmt: skip
# Top-level keys that describe the task and change nothing of a run.
_DESCRIPTIVE = {"schema_version", "version", "source", "task", "metadata"}
_SIZE = re.compile(r"^([0-9]*\.?[0-9]+)([GMK])$")
# Harbor strips leading provenance lines from the prompt (task.py ``strip_canary``): an HTML or
# '#' comment saying "canary", and the blank lines after them.
_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task folder, read. Paths are absolute, inside ``folder``; a number is None
    where task.toml does not set it (``HARBOR_*`` hold Harbor's defaults)."""

    folder: Path
    name: str  # [task] name, else the folder's name (as Harbor names a trial's task)
    prompt: str  # instruction.md, its leading canary lines removed (as Harbor does)
    environment: Path  # the image's build context
    containerfile: Path  # environment/Dockerfile, else environment/Containerfile
    tests: Path  # copied to TESTS_DIR for the verifier
    test_script: Path  # tests/test.sh, run as TEST_SCRIPT
    # tests/Dockerfile. Harbor builds the verifier's image from it only when verifier_separate;
    # else the verifier runs in the agent's container, after the agent, and it is unused.
    verifier_containerfile: Path | None
    verifier_separate: bool  # [verifier] environment_mode "separate", or [verifier.environment]
    solution: Path | None
    cpus: float | None
    memory_mb: int | None
    storage_mb: int | None
    build_timeout_s: float | None
    agent_timeout_s: float | None
    verifier_timeout_s: float | None
    docker_image: str | None  # Harbor's prebuilt image; agenttap builds containerfile
    workdir: str | None  # [environment] workdir, else the image's WORKDIR
    network_mode: str  # one of NETWORK_MODES
    allowed_hosts: tuple[str, ...]
    metadata: dict[str, Any] | None  # [metadata], as written
    unread: tuple[str, ...]  # keys set in task.toml that nothing here acts on ("agent.user")


def read_task(folder: Path) -> HarborTask:
    """The Harbor task in ``folder``, or a ``ValueError`` saying what is wrong, in which file,
    and what to do."""
    folder = Path(folder)
    if not folder.exists():
        raise ValueError(f"task folder {folder} does not exist: give the path of a Harbor task")
    if not folder.is_dir():
        raise ValueError(f"task {folder} is not a folder: give a Harbor task's folder")
    root = folder.resolve()
    _refuse_escaping_links(root)

    config_path = _required_file(root, "task.toml", "the task's configuration")
    instruction = _required_file(root, "instruction.md", "the agent's prompt")
    try:
        config = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{config_path} is not valid TOML ({e}): fix its syntax") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{config_path} is not UTF-8 text: save it as UTF-8") from e

    where = str(config_path)
    env = _table(config, "environment", where)
    agent = _table(config, "agent", where)
    verifier = _table(config, "verifier", where)
    task_table = _table(config, "task", where)
    _refuse_unsupported(root, config, env, where)

    environment = root / "environment"
    if not environment.is_dir():
        raise ValueError(
            f"task {root} has no environment/ folder: add one holding the image's "
            "Dockerfile and the files it copies"
        )
    containerfile = next(
        (environment / n for n in CONTAINERFILES if (environment / n).is_file()), None
    )
    if containerfile is None:
        why = (
            f" (its task.toml names docker_image {env['docker_image']!r}, but agenttap builds "
            "each task's image itself: add a Dockerfile that starts FROM it)"
            if env.get("docker_image")
            else ""
        )
        raise ValueError(
            f"task {root} has no environment/Dockerfile (nor environment/Containerfile){why}: "
            "add the Dockerfile its image is built from"
        )
    tests = root / "tests"
    test_script = _required_file(root, "tests/test.sh", "the verifier's script")

    return HarborTask(
        folder=root,
        name=_optional(task_table, "name", str, where, "task") or root.name,
        prompt=_strip_canary(_text(instruction)),
        environment=environment,
        containerfile=containerfile,
        tests=tests,
        test_script=test_script,
        verifier_containerfile=(tests / "Dockerfile") if (tests / "Dockerfile").is_file() else None,
        verifier_separate=_verifier_separate(verifier, where),
        solution=(root / "solution") if (root / "solution").is_dir() else None,
        cpus=_positive(env, "cpus", where, "environment"),
        memory_mb=_size_mb(env, "memory", where),
        storage_mb=_size_mb(env, "storage", where),
        build_timeout_s=_positive(env, "build_timeout_sec", where, "environment"),
        agent_timeout_s=_positive(agent, "timeout_sec", where, "agent"),
        verifier_timeout_s=_positive(verifier, "timeout_sec", where, "verifier"),
        docker_image=_optional(env, "docker_image", str, where, "environment"),
        workdir=_optional(env, "workdir", str, where, "environment"),
        network_mode=_network_mode(env, where),
        allowed_hosts=tuple(_optional(env, "allowed_hosts", list, where, "environment") or ()),
        metadata=_optional(config, "metadata", dict, where, None),
        unread=_unread(config),
    )


def limits(task: HarborTask) -> tuple[dict[str, int | float], list[str]]:
    """The task's resources as a rollout's ``"limits"`` (the keys of capture/isolation/limits.py
    ``LIMITS``), and, worded for a person, each resource it asks for that agenttap does not
    enforce."""
    mapped: dict[str, int | float] = {}
    unenforced: list[str] = []
    if task.memory_mb is not None:
        mapped["memory_mb"] = task.memory_mb
    if task.storage_mb is not None:
        # Harbor's storage is the container's disk; agenttap's disk_mb caps what a run writes
        # to its work folder, HOME and TMPDIR, the disk an agent fills.
        mapped["disk_mb"] = task.storage_mb
    # cpus: the container engine's own cap (--cpus, capture/rollouts/images.py), not a limit
    # key. What is left unenforced: nothing read here today.
    return mapped, unenforced


def task_hash(task: HarborTask) -> str:
    """The content hash of the task's build context (``context_hash`` of ``environment``)."""
    return context_hash(task.environment)


def context_hash(context: Path) -> str:
    """A SHA-256 (hex) of a build context: every entry's path relative to ``context``, its
    kind, its permission bits, and a file's bytes or a link's target. Times and owners are
    left out, so the same files give the same hash on any checkout and any run; any edit,
    rename, ``chmod`` or new file changes it."""
    digest = hashlib.sha256(b"agenttap build context v1\0")
    for path in sorted(_entries(context), key=lambda p: p.relative_to(context).as_posix()):
        info = path.lstat()
        kind = "l" if stat.S_ISLNK(info.st_mode) else "d" if stat.S_ISDIR(info.st_mode) else "f"
        rel = path.relative_to(context).as_posix().encode()
        digest.update(
            b"%s %d %o\0%s\0" % (kind.encode(), len(rel), stat.S_IMODE(info.st_mode), rel)
        )
        if kind == "l":
            _field(digest, os.readlink(path).encode())
        elif kind == "f":
            with path.open("rb") as f:
                body = hashlib.file_digest(f, "sha256").digest()
            digest.update(b"%d\0" % info.st_size + body)
    return digest.hexdigest()


def _entries(context: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(context):  # never follows a link
        found.extend(Path(dirpath, n) for n in (*dirnames, *filenames))
    return found


def _field(digest: Any, value: bytes) -> None:
    digest.update(b"%d\0" % len(value) + value)


def _refuse_escaping_links(root: Path) -> None:
    """Refuse a link anywhere in the folder that points outside it (a task from the internet
    could name the host's files), one that loops, and what is neither file, folder nor link."""
    for path in [root, *_entries(root)]:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            try:
                target = path.resolve()
            except (RuntimeError, OSError) as e:
                raise ValueError(
                    f"task {root}: {path} is a link that loops ({e}): replace it with the file"
                ) from e
            if not target.is_relative_to(root):
                raise ValueError(
                    f"task {root}: {path} is a link to {target}, outside the task's folder: "
                    "replace it with a copy of what it names"
                )
        elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ValueError(
                f"task {root}: {path} is not a file, folder or link (a device, FIFO or "
                "socket): remove it"
            )


def _required_file(root: Path, name: str, what: str) -> Path:
    path = root / name
    if not path.is_file():
        state = "is not a file" if path.exists() else "is missing"
        raise ValueError(f"task {root}: {name} ({what}) {state}: add it")
    return path


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: save it as UTF-8") from e


def _strip_canary(text: str) -> str:
    lines = text.split("\n")
    start = 0
    while start < len(lines) and _CANARY.match(lines[start].strip()):
        start += 1
    while start < len(lines) and not lines[start].strip():
        start += 1
    return "\n".join(lines[start:])


def _table(config: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be a table ([{key}]), not {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {bool: "true/false", str: "a string", int: "an integer", float: "a number",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)  # fmt: skip


_WANT: dict[type, str] = {str: "a string", list: "an array of strings", dict: "a table"}


def _optional(table: dict[str, Any], key: str, kind: type, where: str, section: str | None) -> Any:
    value: Any = table.get(key)
    if value is None:
        return None
    name = f"[{section}] {key}" if section else key
    strings = not isinstance(value, list) or all(isinstance(v, str) for v in value)
    if not isinstance(value, kind) or not strings:
        raise ValueError(f"{where}: {name} must be {_WANT[kind]}, not {_kind(value)}")
    return value


def _positive(table: dict[str, Any], key: str, where: str, section: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"{where}: [{section}] {key} must be a number, not {_kind(value)} ({value!r})"
        )
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: [{section}] {key} must be above zero, not {value}")
    return float(value)


def _size_mb(env: dict[str, Any], key: str, where: str) -> int | None:
    """``[environment] {key}_mb`` (a whole number of MB), or Harbor's deprecated ``{key}``
    (a string such as "2G", "512M", "1048576K"); both given must agree, as Harbor requires."""
    mb_key = f"{key}_mb"
    mb = env.get(mb_key)
    if mb is not None:
        if isinstance(mb, float) and mb.is_integer():
            mb = int(mb)
        if isinstance(mb, bool) or not isinstance(mb, int):
            raise ValueError(
                f"{where}: [environment] {mb_key} must be a whole number of MB, "
                f"not {_kind(mb)} ({mb!r})"
            )
        if mb <= 0:
            raise ValueError(f"{where}: [environment] {mb_key} must be above zero, not {mb}")
    legacy = env.get(key)
    if legacy is None:
        return mb
    if not isinstance(legacy, str):
        # Harbor drops a non-string here without a word; a limit that vanishes is worse than
        # an error.
        raise ValueError(
            f'{where}: [environment] {key} must be a size string like "2G" or "512M", not '
            f"{_kind(legacy)} ({legacy!r}): or give {mb_key} = <MB>"
        )
    match = _SIZE.match(legacy.strip().upper())
    if match is None:
        raise ValueError(
            f'{where}: [environment] {key} = {legacy!r} is not a size like "2G", "512M" or '
            f'"1048576K": write it so, or give {mb_key} = <MB>'
        )
    number, unit = float(match[1]), match[2]
    legacy_mb = int(number * 1024 if unit == "G" else number if unit == "M" else number / 1024)
    if legacy_mb <= 0:
        raise ValueError(
            f"{where}: [environment] {key} = {legacy!r} is under 1 MB: give at least 1M"
        )
    if mb is not None and mb != legacy_mb:
        raise ValueError(
            f"{where}: [environment] {key} = {legacy!r} ({legacy_mb} MB) and {mb_key} = {mb} "
            f"disagree: keep only {mb_key}"
        )
    return legacy_mb


def _network_mode(env: dict[str, Any], where: str) -> str:
    mode = _optional(env, "network_mode", str, where, "environment")
    allow = env.get("allow_internet")
    if allow is not None and not isinstance(allow, bool):
        raise ValueError(
            f"{where}: [environment] allow_internet must be true or false, not {_kind(allow)}"
        )
    if mode is None:
        # Harbor's deprecated allow_internet counts only where network_mode is not given.
        mode = "no-network" if allow is False else HARBOR_NETWORK_MODE
    if mode not in NETWORK_MODES:
        raise ValueError(
            f"{where}: [environment] network_mode = {mode!r} is not one of "
            f"{', '.join(NETWORK_MODES)}"
        )
    if env.get("allowed_hosts") and mode != "allowlist":
        raise ValueError(
            f'{where}: [environment] allowed_hosts needs network_mode = "allowlist" '
            f"(it is {mode!r}): set it, or remove allowed_hosts"
        )
    return mode


def _verifier_separate(verifier: dict[str, Any], where: str) -> bool:
    # harbor/models/task/verifier_mode.py: "separate" when said, or when [verifier.environment]
    # is given; else "shared" (the agent's container, after the agent).
    mode = _optional(verifier, "environment_mode", str, where, "verifier")
    if mode not in (None, "shared", "separate"):
        raise ValueError(
            f'{where}: [verifier] environment_mode = {mode!r} is not "shared" or "separate"'
        )
    if mode == "shared" and verifier.get("environment") is not None:
        raise ValueError(
            f'{where}: [verifier] environment_mode = "shared" cannot have '
            '[verifier.environment]: remove one, or set environment_mode = "separate"'
        )
    return mode == "separate" or (mode is None and verifier.get("environment") is not None)


def _refuse_unsupported(
    root: Path, config: dict[str, Any], env: dict[str, Any], where: str
) -> None:
    if config.get("steps"):
        raise ValueError(
            f"{where}: the task has [[steps]] (a multi-step task): agenttap runs single-step "
            "Harbor tasks, one instruction.md and one tests/test.sh"
        )
    system = env.get("os", "linux")
    if not isinstance(system, str) or system.lower() != "linux":
        raise ValueError(f"{where}: [environment] os = {system!r}: agenttap runs Linux images only")
    compose = [n for n in COMPOSE_FILES if (root / "environment" / n).exists()]
    if compose:
        raise ValueError(
            f"task {root}: environment/{compose[0]} describes several containers, and agenttap "
            "runs a task in one: collapse it into environment/Dockerfile"
        )


def _unread(config: dict[str, Any]) -> tuple[str, ...]:
    unread: list[str] = []
    for key, value in config.items():
        if key in _DESCRIPTIVE:
            continue
        if key not in _READ or not isinstance(value, dict):
            unread.append(key)
            continue
        unread.extend(f"{key}.{k}" for k in value if k not in _READ[key])
    verifier_env = config.get("verifier", {}).get("environment")
    if isinstance(verifier_env, dict):
        # Only its presence is read (the verifier's own container); what it sets is not.
        unread.extend(f"verifier.environment.{k}" for k in verifier_env)
    return tuple(sorted(unread))
