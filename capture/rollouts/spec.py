"""A ``POST /rollouts`` request: ``parse_rollout`` checks its body and reads it into a
``RolloutSpec`` (capture/rollouts/runner.py runs it); a ``ValueError`` worded for the caller
otherwise.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from capture.control.models import ID_PATTERN, SessionFields, SessionLimits, Words, read_body
from capture.control.sessions import (
    Limits,
    parse_limits,
    reject_unknown,
)
from capture.harbor.task import TEST_SCRIPT, HarborTask, read_task
from capture.harbor.task import limits as task_limits
from capture.isolation.limits import SANDBOX_LIMIT_KEYS, SandboxLimits, parse_sandbox_limits
from capture.rollouts.agents import AGENTS, agent_command
from capture.rollouts.verifier import VerifierSpec, parse_verifier

# The most a rollout request may ask for at once (the cap applies on top of it).
MAX_N = 256
SANDBOXES = ("bwrap", "none")
# What a sandboxed agent may reach beyond the policy's API hosts, through the proxy: "none"
# (nothing) or "public" (public hosts; never loopback, private or link-local addresses, the
# policy servers or the control API).
EGRESS = ("none", "public")


@dataclass
class RolloutSpec:
    agent: Any
    prompt: str
    command: list[str]
    agent_env: dict[str, str]
    n: int = 1
    workdir: Path | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    # The kernel's limits on each agent and verifier (memory, pids, disk, CPU, output).
    sandbox_limits: SandboxLimits = field(default_factory=SandboxLimits)
    metadata: dict[str, Any] = field(default_factory=dict)
    # What scores each agent, on which files, and how its reward is read
    # (capture/rollouts/verifier.py); None: its rows carry no reward.
    verifier: VerifierSpec | None = None
    # "bwrap" or "none"; None: the option's (agenttap_sandbox).
    sandbox: str | None = None
    # Shown read-only in the sandbox, beyond the system, the agent's install and the CA.
    expose: tuple[Path, ...] = ()
    egress: str = "none"
    timeout_s: float = 3600.0
    id: str = ""
    # Seeds the policy's sampling: each agent's session gets a seed of its own from it
    # (capture.control.sessions.agent_seed), each call one from that and its prompt. None: not.
    seed: int | None = None
    # A container image each agent and its verifier run in (the podman engine), and the folder
    # inside it they start in (None: the image's WORKDIR).
    image: str | None = None
    cwd: str | None = None
    # A Harbor task folder (capture/harbor/task.py): its image built from environment/ before
    # the runs (``image`` set then), its instruction the prompt, tests/test.sh the verifier.
    task: HarborTask | None = None
    # The number of its first agent: agent i's session is ID-i and its seed agent_seed(seed, i).
    # A Ray pool runs one group as shares on several proxies, each from its own first index.
    first_index: int = 0


# The fields of a body, in the order they have always been checked (and named when unknown).
KNOWN = (
    "agent", "prompt", "workdir", "n", "limits", "metadata", "verifier", "id", "sandbox",
    "expose", "egress", "seed", "timeout_s", "wait", "rows", "image", "cwd", "task",
    "first_index",
)  # fmt: skip
# An image reference: [registry/]name[:tag][@digest], as podman and docker read one.
IMAGE_REF = re.compile(r"[a-z0-9][a-z0-9._/:-]{0,254}(@sha256:[0-9a-f]{64})?")
AGENT_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {"type": "string", "enum": list(AGENTS)},
        {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
            "additionalProperties": False,
        },
    ]
}
LIMITS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "the session's limits and the kernel's on each agent and verifier",
    "properties": {
        **SessionLimits.model_json_schema()["properties"],
        **{
            key: {"type": "number", "exclusiveMinimum": 0}
            if key == "cpu_s"
            else {"type": "integer", "minimum": 1}
            for key in SANDBOX_LIMIT_KEYS
        },
    },
    "additionalProperties": False,
}
VERIFIER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "one of command and pytest (a list alone: the command)",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}},
        "pytest": {
            "type": "array",
            "items": {"type": "string"},
            "description": "node ids: the reward is the share that passed (a JUnit report, "
            "on the seed)",
        },
        "python": {"type": "string"},
        "keep": {
            "type": "array",
            "items": {"type": "string"},
            "description": "globs of the agent's files graded on a fresh copy of the seed workdir",
        },
        "restore": {
            "type": "array",
            "items": {"type": "string"},
            "description": "relative paths put back from the workdir into the agent's copy "
            "before scoring",
        },
        "on_error": {"type": "string", "enum": ["skip", "score"]},
        "reward_range": {
            "type": "array",
            "items": {"type": "number"},
            "minItems": 2,
            "maxItems": 2,
            "description": "[lo, hi], default [0, 1]",
        },
    },
}
NUL = "holds a NUL character, which no command line can carry"
# What a caller is told when pydantic refuses a field (its type, a bound, a missing one).
WORDS: dict[str, Words] = {
    "prompt": '"prompt" must be the task, as text',
    "agent": f'"agent" must be one of {", ".join(AGENTS)} or '
    '{"command": ["program", "arg", ...]}',
    "n": f'"n" must be a whole number from 1 to {MAX_N}',
    "sandbox": f'"sandbox" must be one of {", ".join(SANDBOXES)}',
    "egress": '"egress" must be "none" (the agent reaches only the policy) or "public" (public '
    "hosts too, through the proxy)",
    "seed": '"seed" must be a whole number (the same seed, the same samples)',
    "first_index": '"first_index" must be a whole number from 0 to 1048576 (the number of the '
    "first agent: its session is ID-first_index)",
    "wait": '"wait" must be true or false',
    "rows": '"rows" must be true (each rollout\'s rows in the answer) or false',
}


class RolloutBody(SessionFields):
    """``POST /rollouts``: the fields in the order they are checked (a body with two mistakes
    is told of the first)."""

    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[str, Field(strict=True, description="the task")]
    agent: Annotated[
        Any,
        WithJsonSchema(AGENT_SCHEMA),
        Field(description="a CLI, or a command (the prompt last)"),
    ]
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N, description="agents, one group")] = 1
    workdir: Annotated[
        Path | None,
        WithJsonSchema({"type": "string", "description": "a folder each agent gets a copy of"}),
    ] = None
    image: Annotated[
        str | None,
        WithJsonSchema(
            {"type": "string", "description": "a container image each agent runs in (podman)"}
        ),
    ] = None
    cwd: Annotated[
        str | None,
        WithJsonSchema(
            {"type": "string", "description": "where in the image it starts; default its WORKDIR"}
        ),
    ] = None
    task: Annotated[
        Any,
        WithJsonSchema(
            {
                "type": "string",
                "description": "a Harbor task folder: its image, instruction, tests and limits",
            }
        ),
    ] = None
    # Read even when left out: the kernel's limits have defaults.
    limits: Annotated[Any, WithJsonSchema(LIMITS_SCHEMA), Field(validate_default=True)] = None
    verifier: Annotated[Any, WithJsonSchema(VERIFIER_SCHEMA)] = None
    sandbox: Annotated[
        Literal["bwrap", "none"] | None,
        Field(description="how the agent and verifier run; default: agenttap_sandbox (bwrap)"),
    ] = None
    expose: Annotated[
        tuple[Path, ...],
        WithJsonSchema(
            {
                "type": "array",
                "items": {"type": "string"},
                "description": "absolute paths shown read-only in the sandbox",
            }
        ),
    ] = ()
    egress: Literal["none", "public"] = "none"
    timeout_s: Annotated[
        float | None, WithJsonSchema({"type": "number", "exclusiveMinimum": 0})
    ] = None
    id: Annotated[str, Field(pattern=ID_PATTERN, description="else one is made")] | None = None
    seed: StrictInt | None = None
    first_index: Annotated[
        StrictInt,
        Field(ge=0, le=1 << 20, description="the first agent's number (a share of a group)"),
    ] = 0
    metadata: Annotated[dict[str, Any], Field(description="written on every row")] = {}
    wait: Annotated[StrictBool, Field(description="false: answer 202 at once")] = True
    rows: Annotated[
        StrictBool, Field(description="false: each rollout's summary without its rows")
    ] = True

    @model_validator(mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        if isinstance(value, dict):
            reject_unknown(value, KNOWN)
            if value.get("task") is not None:
                value = with_task(value)
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: str) -> str:
        if not prompt.strip():
            raise ValueError(WORDS["prompt"])
        if "\x00" in prompt:
            raise ValueError(f'"prompt" {NUL}')
        return prompt

    @field_validator("agent")
    @classmethod
    def _agent(cls, agent: Any, info: ValidationInfo) -> Any:
        if "prompt" in info.data:  # else the prompt's error is told first
            command, _ = agent_command(agent, info.data["prompt"])
            if any("\x00" in arg for arg in command):
                raise ValueError(f'"agent.command" {NUL}')
        return agent

    @field_validator("workdir", mode="before")
    @classmethod
    def _workdir(cls, workdir: Any) -> Path | None:
        if workdir is None:
            return None
        if not isinstance(workdir, str):
            raise ValueError('"workdir" must be a folder path on the proxy\'s machine')
        path = Path(workdir).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f'"workdir" {str(path)!r} is not a folder on the proxy\'s machine')
        return path

    @field_validator("image", mode="before")
    @classmethod
    def _image(cls, image: Any, info: ValidationInfo) -> str | None:
        if image is None:
            return None
        if not isinstance(image, str) or not IMAGE_REF.fullmatch(image):
            raise ValueError('"image" must be an image reference: NAME[:TAG] (lower case)')
        if info.data.get("workdir") is not None:
            raise ValueError(
                '"image" and "workdir": an image holds its own working folder; put the task\'s '
                'files in the image (FROM it, COPY them), or give "workdir" alone'
            )
        return image

    @field_validator("cwd", mode="before")
    @classmethod
    def _cwd(cls, cwd: Any, info: ValidationInfo) -> str | None:
        if cwd is None:
            return None
        if info.data.get("image") is None:
            raise ValueError('"cwd" is the folder inside the "image" to start in: give an image')
        if not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd:
            raise ValueError('"cwd" must be an absolute path inside the image')
        if ".." in cwd.split("/"):
            raise ValueError('"cwd" must not hold ".."')
        return cwd

    @field_validator("limits")
    @classmethod
    def _limits(cls, value: Any) -> tuple[SandboxLimits, Limits]:
        if value is not None and not isinstance(value, dict):
            keys = ", ".join(f'"{key}"' for key in LIMITS_SCHEMA["properties"])
            raise ValueError(f'"limits" must be an object: {{{keys}}}')
        sandbox_limits = parse_sandbox_limits(value, SandboxLimits())
        session = {k: v for k, v in (value or {}).items() if k not in SANDBOX_LIMIT_KEYS}
        return sandbox_limits, parse_limits(session)

    @field_validator("verifier")
    @classmethod
    def _verifier(cls, value: Any, info: ValidationInfo) -> VerifierSpec | None:
        if value is None:
            return None
        has_files = info.data.get("workdir") is not None or info.data.get("image") is not None
        task = info.data.get("task")
        verifier = parse_verifier(value, has_workdir=has_files or task is not None)
        if task is not None:
            # Harbor's convention for its own tests; the task's tests shown at /tests, in the
            # verifier's container only, unless the caller named others.
            harbor = list(verifier.command) == ["bash", TEST_SCRIPT]
            return replace(
                verifier,
                tests=verifier.tests or task.tests,
                harbor=harbor,
                timeout_s=task.verifier_timeout_s,
            )
        if info.data.get("image") is not None and verifier.pytest:
            raise ValueError(
                '"verifier.pytest" runs the proxy\'s Python; in an "image" give "command" (the '
                'image\'s own tools, e.g. ["python3", "-m", "pytest", "/tests"]) and '
                '"tests"'
            )
        if verifier.tests is not None and info.data.get("image") is None:
            raise ValueError('"verifier.tests" is shown at /tests in the "image": give an image')
        return verifier

    @field_validator("sandbox")
    @classmethod
    def _sandbox(cls, sandbox: str | None, info: ValidationInfo) -> str | None:
        if sandbox is not None and info.data.get("image") is not None:
            raise ValueError(
                '"sandbox" and "image": a rollout with an image runs in its container (podman)'
            )
        return sandbox

    @field_validator("expose", mode="before")
    @classmethod
    def _expose(cls, value: Any) -> tuple[Path, ...]:
        return parse_expose(value)

    @field_validator("timeout_s", mode="before")
    @classmethod
    def _timeout(cls, timeout: Any) -> float | None:
        if timeout is None:
            return None
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError('"timeout_s" must be a number of seconds > 0')
        if not math.isfinite(timeout):
            raise ValueError('"timeout_s" must be finite')
        return float(timeout)

    def spec(self) -> RolloutSpec:
        """The rollout the runner starts."""
        command, agent_env = agent_command(self.agent, self.prompt)
        sandbox_limits, limits = self.limits
        timeout = self.timeout_s
        if timeout is None:
            timeout = (limits.deadline_s + 60.0) if limits.deadline_s else 3600.0
        return RolloutSpec(
            agent=self.agent,
            prompt=self.prompt,
            command=command,
            agent_env=agent_env,
            n=self.n,
            workdir=self.workdir,
            limits={k: v for k, v in vars(limits).items() if v is not None},
            sandbox_limits=sandbox_limits,
            metadata=self.metadata,
            verifier=self.verifier,
            sandbox=self.sandbox,
            expose=self.expose,
            egress=self.egress,
            timeout_s=timeout,
            id=self.id or "r-" + uuid.uuid4().hex[:12],
            seed=self.seed,
            image=self.image,
            cwd=self.cwd,
            task=self.task,
            first_index=self.first_index,
        )


def with_task(body: dict[str, Any]) -> dict[str, Any]:
    """A body naming a Harbor ``"task"`` folder, with what the task gives filled in where the
    body leaves it out: the prompt (instruction.md), the limits (task.toml's memory and
    storage), the agent's timeout and the verifier (tests/test.sh, its reward what it writes to
    /logs/verifier, its timeout). ValueError worded for the caller for a folder that is no task."""
    folder = body["task"]
    if not isinstance(folder, str) or not folder.startswith("/") or "\x00" in folder:
        raise ValueError('"task" must be the absolute path of a Harbor task folder')
    for key in ("image", "workdir", "sandbox"):
        if key in body:
            raise ValueError(
                f'"task" and "{key}": a Harbor task builds its own image from environment/'
            )
    task = read_task(Path(folder))
    filled: dict[str, Any] = {**body, "task": task}
    filled.setdefault("prompt", task.prompt)
    given, _ = task_limits(task)
    # Its disk is RAM (a tmpfs charged to memory_mb): at most half the task's memory.
    if "disk_mb" in given and "memory_mb" in given:
        given["disk_mb"] = min(int(given["disk_mb"]), max(1, int(given["memory_mb"]) // 2))
    limits = body.get("limits")
    if limits is None or isinstance(limits, dict):  # else the limits' own error is told
        filled["limits"] = {**given, **(limits or {})}
    if task.agent_timeout_s is not None:
        filled.setdefault("timeout_s", task.agent_timeout_s)
    verifier = body.get("verifier")
    if verifier is None:
        filled["verifier"] = {"command": ["bash", TEST_SCRIPT]}
    elif isinstance(verifier, dict) and not {"command", "pytest"} & set(verifier):
        # Its own settings ("on_error", "reward_range", "keep") for the task's test script.
        filled["verifier"] = {"command": ["bash", TEST_SCRIPT], **verifier}
    return filled


def read_rollout(body: Any) -> RolloutBody:
    """A ``POST /rollouts`` body; a ValueError worded for the caller otherwise."""
    return read_body(RolloutBody, body, WORDS)


def parse_rollout(body: Any) -> RolloutSpec:
    """A ``POST /rollouts`` body as the rollout it asks for; ValueError worded for the caller
    otherwise."""
    return read_rollout(body).spec()


def parse_expose(value: Any) -> tuple[Path, ...]:
    """A rollout's ``"expose"``: absolute paths on the proxy's machine that exist."""
    if value is None:
        return ()
    words = '"expose" must be a list of absolute paths on the proxy\'s machine, shown read-only'
    if not isinstance(value, list):
        raise ValueError(words)
    paths = []
    for item in value:
        if not isinstance(item, str) or not item.startswith("/") or "\x00" in item:
            raise ValueError(f"{words}; not {item!r}")
        path = Path(item)
        if not path.exists():
            raise ValueError(f'"expose": {item!r} does not exist on the proxy\'s machine')
        paths.append(path)
    return tuple(paths)
