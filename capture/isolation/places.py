"""Where a sandboxed run's folders appear inside (``agenttap_sandbox_paths`` fixed): its work,
HOME and TMPDIR at the same places on every host, and every value of its command and
environment that names them by their host paths renamed to match (``moved_value``, which the
container engine uses for its own places too).

An agent's prompt names its working folder (Claude Code's, Codex's, Gemini CLI's do): at fixed
places it does not depend on where OUT is, so one seed repeats a run in any folder, and a
group's prompts are one, sharing the policy's prefix cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Where a run's work, HOME and TMPDIR appear inside a bubblewrap sandbox (agenttap_sandbox_paths
# fixed): the same in every folder and on every machine, so an agent's prompt, which names its
# working directory, does not depend on where OUT is; a group's prompts stay identical and share
# the policy's prefix cache.
WORK_INSIDE = "/workdir"
HOME_INSIDE = "/home/agent"
TMP_INSIDE = "/tmp/agent"
FIXED_PLACES = (WORK_INSIDE, HOME_INSIDE, TMP_INSIDE)


def fixed_layout(
    folders: tuple[Path, Path, Path], expose: tuple[Path, ...]
) -> tuple[dict[str, str], tuple[Path, ...]] | None:
    """A run's ``folders`` (work, HOME, TMPDIR) at ``FIXED_PLACES``: where each of their host
    paths (as given and real) appears inside, and ``expose`` less what lies in them (a file of
    the run's an argument names is shown with its folder). None when a fixed place and a path
    the sandbox shows at its own path lie one inside the other (an install under ``/workdir``
    on this host): a bind there would make mount points in the run's own folder, or hide the
    install. The run's folders are then shown at their host paths."""
    moved: dict[str, str] = {}
    for folder, inside in zip(folders, FIXED_PLACES, strict=True):
        moved[str(folder)] = moved[os.path.realpath(folder)] = inside
    outside = tuple(p for p in expose if moved_value(str(p), moved) == str(p))
    shown = {Path(os.path.realpath(p)) for p in outside if str(p)}
    for place in map(Path, FIXED_PLACES):
        for path in shown:
            if path.is_relative_to(place) or place.is_relative_to(path):
                return None
    return moved, outside


def moved_value(value: str, places: dict[str, str]) -> str:
    """``value`` (an environment value or an argument) with each of a run's folders it names by
    its host path named as the sandbox shows it (``places``: host path -> inside): the whole
    value, or after a ``=`` (``--junitxml=PATH``) or a ``:`` (a ``PATH``-like list)."""
    for host, inside in sorted(places.items(), key=lambda item: -len(item[0])):
        if host in value:
            replacement = r"\g<1>" + inside.replace("\\", r"\\")
            value = re.sub(rf"(^|[=:]){re.escape(host)}(?=$|[/:])", replacement, value)
    return value
