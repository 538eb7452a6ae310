"""A rollout in its task's own image (``"image"``): what its runs start from and what the
verifier starts from.

Before any run: the image is read (its WORKDIR, its PATH); one that is not here fails every run
with words that say how to get it. The agent runs in a container of the image (the podman
engine, capture/isolation/containers.py): its own program brought in from the host, its tool
calls the image's own tools. Its working folder is the run's own copy of the image's
(``work/``, on the run's size-capped disk, bound at the image's WORKDIR, kept with the run).
Once every process of it is gone, for a verifier that grades the agent's state, the stopped
container is committed: the verifier starts from exactly what the agent left, with the
task's hidden tests shown at ``/tests`` (read-only, in the verifier's container only: nothing
the agent left there is seen). With ``"keep"`` the verifier starts from the image as built, the
agent's kept files copied onto its working folder (SWE-bench's grade: the patch on a clean
checkout).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import subprocess
from pathlib import Path

from capture.harbor.task import HARBOR_BUILD_TIMEOUT_S, VERIFIER_LOGS
from capture.isolation.containers import (
    LABEL,
    OWNER,
    Bind,
    Container,
    ContainerPlan,
    EngineError,
    engine_call,
    image_config,
    remove_image,
)
from capture.isolation.images import build_image
from capture.rollouts.agents import container_tools
from capture.rollouts.runs import Rollout, Run

logger = logging.getLogger(__name__)

TESTS_AT = "/tests"
# Where a verifier that grades the agent's state starts: its stopped container, committed.
STATE_REPO = "localhost/agenttap-state"


async def build_task(rollout: Rollout) -> None:
    """A Harbor task's image built from its environment/ (cached by the build context's hash:
    built once), as the rollout's ``image``; with a verifier of its own (tests/Dockerfile,
    ``environment_mode = "separate"``), that image too. Failing: ``image_error``."""
    task = rollout.spec.task
    assert task is not None
    timeout = task.build_timeout_s or HARBOR_BUILD_TIMEOUT_S
    try:
        rollout.spec.image = await asyncio.to_thread(
            build_image, task.environment, task.containerfile, timeout=timeout
        )
        if task.verifier_separate and task.verifier_containerfile is not None:
            rollout.verifier_image = await asyncio.to_thread(
                build_image, task.tests, task.verifier_containerfile, timeout=timeout
            )
    except (OSError, ValueError) as exc:
        rollout.image_error = f"the task's image could not be built: {exc}"


async def read_image(rollout: Rollout, seed: Path) -> None:
    """The image's WORKDIR and PATH onto ``rollout``, and its working folder as built copied
    to ``seed`` (what each run's copy starts from). Failing: ``image_error``, which every run
    reports."""
    spec = rollout.spec
    assert spec.image is not None
    try:
        config = await image_config(spec.image)
    except EngineError as exc:
        rollout.image_error = (
            f"the image {spec.image!r} cannot be used ({exc}): build it (podman build -t "
            f"{spec.image} FOLDER) or pull it on the proxy's machine first"
        )
        return
    rollout.image_workdir = spec.cwd or config.get("WorkingDir") or "/"
    for entry in config.get("Env") or []:
        if isinstance(entry, str) and entry.startswith("PATH="):
            rollout.image_path = entry[5:]
    try:
        await copy_workdir(spec.image, rollout.image_workdir, seed, f"{rollout.id}-seed")
    except EngineError as exc:
        rollout.image_error = f"the image's working folder could not be read: {exc}"
        return
    rollout.image_seed = seed


def copy_tree(seed: Path, dest: Path) -> None:
    """An image's working folder copied for one run, as it is: its links stay links (they
    resolve in the container, never on this host), its modes kept. Blocking: in a thread."""
    done = subprocess.run(
        ["cp", "-a", "--no-dereference", "--", f"{seed}/.", str(dest)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise OSError(f"the image's working folder could not be copied: {done.stderr.strip()}")


async def copy_workdir(image: str, workdir: str, dest: Path, name: str) -> None:
    """``workdir`` as ``image`` holds it, copied to ``dest`` (from a container never started)."""
    # A token of its own: another agenttap on this host (a pool's second actor) may copy the
    # same rollout id's seed at once.
    container = Container(f"agenttap-{name}-{secrets.token_hex(3)}")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        # Labelled as every container of this instance: a crash here leaves none behind.
        await engine_call(
            ["create", "--name", container.name, "--label", f"{LABEL}={OWNER}", image, "true"],
            container.engine,
        )
        container.created = True
        await container.copy_out(workdir, dest)
    finally:
        await container.remove()


def agent_plan(rollout: Rollout, work: Path) -> ContainerPlan:
    """The agent's container: its working folder the run's ``work`` (a copy of the image's, on
    the run's size-capped disk), bound at the image's; a named agent brought in from the host,
    a ``{"command"}`` agent the image's own program. Kept once stopped when the verifier grades
    its state."""
    spec = rollout.spec
    assert spec.image is not None
    return ContainerPlan(
        image=spec.image,
        cwd=rollout.image_workdir,
        path=rollout.image_path,
        from_host=isinstance(spec.agent, str),
        binds=(Bind(work, rollout.image_workdir, read_only=False),),
        keep=grades_state(rollout),
        cpus=spec.task.cpus if spec.task is not None else None,
        tools=container_tools(spec.agent),
    )


def grades_state(rollout: Rollout) -> bool:
    """Whether the verifier starts from the state the agent left (not from the image)."""
    verifier = rollout.spec.verifier
    return verifier is not None and verifier.keep is None


async def after_agent(rollout: Rollout, run: Run) -> None:
    """Once the agent's processes are gone: when the verifier grades its state, its container
    committed (all but the working folder, which is the run's ``work/`` already)."""
    handle = run.handle
    container = handle.child.container if handle is not None and handle.child else None
    if not isinstance(container, Container):
        return
    try:
        if grades_state(rollout) and run.error is None:
            tag = f"{STATE_REPO}:{container.name.removeprefix('agenttap-')}".lower()
            run.state_image = await container.commit(tag)
    except EngineError as exc:
        run.error = f"the agent's container could not be kept for the verifier: {exc}"
    finally:
        await container.remove()


def verifier_plan(
    rollout: Rollout, run: Run, work: Path, graded: bool, logs: Path | None = None
) -> ContainerPlan:
    """The verifier's container: the agent's committed state with its ``work`` on the working
    folder, or (``keep``: ``graded``) the image as built with ``work`` the seed plus the kept
    files; the hidden tests at /tests. Its command is the image's own."""
    spec = rollout.spec
    verifier = spec.verifier
    assert spec.image is not None and verifier is not None
    binds = [Bind(work, rollout.image_workdir, read_only=False)]
    if verifier.tests is not None:
        binds.append(Bind(verifier.tests, TESTS_AT))
    if logs is not None:  # Harbor's reward folder, fresh: what the agent left there is hidden
        binds.append(Bind(logs, VERIFIER_LOGS, read_only=False))
    if rollout.verifier_image is not None:  # a verifier with a container of its own (Harbor)
        image = rollout.verifier_image
    elif graded:
        image = spec.image
    else:
        assert run.state_image is not None
        image = run.state_image
    return ContainerPlan(
        image=image,
        cwd=rollout.image_workdir,
        path=rollout.image_path,
        binds=tuple(binds),
        cpus=spec.task.cpus if spec.task is not None else None,
    )


async def forget_state(rollout: Rollout, run: Run) -> None:
    """The run's committed state removed (once it was scored, or not)."""
    tag, run.state_image = run.state_image, None
    if tag is not None:
        await remove_image(tag)
