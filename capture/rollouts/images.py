"""A rollout in its task's own image (``"image"``): what its runs start from and what the
verifier starts from.

Before any run: the image is read (its WORKDIR, its PATH); one that is not here fails every run
with words that say how to get it. The agent runs in a container of the image (the podman
engine, capture/isolation/containers.py): its own program brought in from the host, its tool
calls the image's own tools. Once every process of it is gone, its working folder is copied
out (``work/``, kept with the run) and, for a verifier that grades the agent's state, the
stopped container is committed: the verifier starts from exactly what the agent left, with the
task's hidden tests shown at ``/tests`` (read-only, in the verifier's container only: nothing
the agent left there is seen). With ``"keep"`` the verifier starts from the image as built, the
agent's kept files copied onto its working folder (SWE-bench's grade: the patch on a clean
checkout).
"""

from __future__ import annotations

import logging
from pathlib import Path

from capture.isolation.containers import (
    Bind,
    Container,
    ContainerPlan,
    EngineError,
    engine_call,
    image_config,
    remove_image,
)
from capture.logs.escape import printable
from capture.rollouts.runs import Rollout, Run

logger = logging.getLogger(__name__)

TESTS_AT = "/tests"
# Where a verifier that grades the agent's state starts: its stopped container, committed.
STATE_REPO = "localhost/agenttap-state"


async def read_image(rollout: Rollout, seed: Path) -> None:
    """The image's WORKDIR and PATH onto ``rollout``; with ``keep``, its working folder as
    built copied to ``seed``. Failing: ``image_error``, which every run reports."""
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
    if spec.verifier is not None and spec.verifier.keep is not None:
        try:
            await copy_workdir(spec.image, rollout.image_workdir, seed, f"{rollout.id}-seed")
        except EngineError as exc:
            rollout.image_error = f"the image's working folder could not be read: {exc}"
            return
        rollout.image_seed = seed


async def copy_workdir(image: str, workdir: str, dest: Path, name: str) -> None:
    """``workdir`` as ``image`` holds it, copied to ``dest`` (from a container never started)."""
    container = Container(f"agenttap-{name}")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        await engine_call(["create", "--name", container.name, image, "true"], container.engine)
        container.created = True
        await container.copy_out(workdir, dest)
    finally:
        await container.remove()


def agent_plan(rollout: Rollout) -> ContainerPlan:
    """The agent's container: a named agent is brought in from the host; a ``{"command"}``
    agent is the image's own program. Kept once stopped when the verifier grades its state."""
    spec = rollout.spec
    assert spec.image is not None
    verifier = spec.verifier
    return ContainerPlan(
        image=spec.image,
        cwd=rollout.image_workdir,
        path=rollout.image_path,
        from_host=isinstance(spec.agent, str),
        keep=verifier is not None and verifier.keep is None,
    )


async def after_agent(rollout: Rollout, run: Run, work: Path) -> None:
    """Once the agent's processes are gone: its working folder copied out to ``work`` (kept
    with the run) and, when the verifier grades its state, its container committed."""
    handle = run.handle
    container = handle.child.container if handle is not None and handle.child else None
    if not isinstance(container, Container):
        return
    try:
        try:
            await container.copy_out(rollout.image_workdir, work)
        except EngineError as exc:
            logger.warning(
                "agenttap: rollout %s/%d: the agent's working folder was not kept: %s",
                rollout.id, run.index, printable(str(exc)),
            )  # fmt: skip
        if agent_plan(rollout).keep and run.error is None:
            tag = f"{STATE_REPO}:{container.name.removeprefix('agenttap-')}".lower()
            run.state_image = await container.commit(tag)
    except EngineError as exc:
        run.error = f"the agent's container could not be kept for the verifier: {exc}"
    finally:
        await container.remove()


def verifier_plan(rollout: Rollout, run: Run, graded: Path | None) -> ContainerPlan:
    """The verifier's container: the agent's committed state, or (``keep``) the image as
    built with ``graded`` (the seed and the kept files) on its working folder; the hidden
    tests at /tests. Its command is the image's own."""
    spec = rollout.spec
    verifier = spec.verifier
    assert spec.image is not None and verifier is not None
    binds: list[Bind] = []
    if verifier.tests is not None:
        binds.append(Bind(verifier.tests, TESTS_AT))
    if graded is not None:
        image = spec.image
        binds.append(Bind(graded, rollout.image_workdir, read_only=False))
    else:
        assert run.state_image is not None
        image = run.state_image
    return ContainerPlan(
        image=image, cwd=rollout.image_workdir, path=rollout.image_path, binds=tuple(binds)
    )


async def forget_state(rollout: Rollout, run: Run) -> None:
    """The run's committed state removed (once it was scored, or not)."""
    tag, run.state_image = run.state_image, None
    if tag is not None:
        await remove_image(tag)
