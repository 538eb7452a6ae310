"""How agenttap calls its container engine: podman (or docker, ``agenttap_container_engine``)
with a configuration of its own, so the host's stays untouched.

Measured on Debian 12 (../shared/notes/images.md): podman's default runtime ``crun`` refuses a
host whose cgroups are in hybrid mode, ``runc`` works; a root process without
``CAP_SYS_RESOURCE`` may only lower rlimits, and podman raises ``nofile`` and ``nproc`` by
default, so containers start with both lowered. ``engine_command`` gives the argv prefix and
``engine_env`` the environment every engine call runs with.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import tempfile
from pathlib import Path

ENGINES = ("podman", "docker")
# What every container agenttap starts carries, to find its own (and a crashed instance's).
LABEL = "io.agenttap.owner"
_CONF_DIR = Path(tempfile.gettempdir()) / f"agenttap-containers-{os.geteuid()}"


class EngineMissing(ValueError):
    """The container engine is not installed: what to install, in words for the caller."""


def ulimits() -> tuple[int, int]:
    """``nofile`` and ``nproc`` for a container: at most this process's own hard limits (a
    container may only lower them here)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]

    def bounded(hard: int, cap: int) -> int:
        return cap if hard == resource.RLIM_INFINITY else min(hard, cap)

    # nproc: runc refused 65536 and more here with a hard limit of 96365 (measured); a run's
    # processes are capped by its cgroup's pids limit anyway.
    return bounded(nofile, 1 << 16), bounded(nproc, 32768)


def containers_conf() -> Path:
    """podman's configuration file of agenttap's own: runc as the runtime, rlimits no higher
    than this process's (written once per user; the host's containers.conf is not read)."""
    nofile, nproc = ulimits()
    text = (
        "# Written by agenttap (capture/isolation/podman.py): runc, rlimits lowered.\n"
        '[engine]\nruntime = "runc"\n'
        f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
    )
    # Named by its text: another instance with other limits never rewrites it under us.
    path = _CONF_DIR / f"containers-{hashlib.sha256(text.encode()).hexdigest()[:12]}.conf"
    if not path.exists() or path.read_text() != text:
        _CONF_DIR.mkdir(mode=0o700, exist_ok=True)
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(text)
        staged.replace(path)
    return path


def engine_command(engine: str = "podman") -> list[str]:
    """The argv prefix of every call to ``engine``; EngineMissing when it is not installed."""
    if engine not in ENGINES:
        raise ValueError(f"container engine {engine!r}: not one of {', '.join(ENGINES)}")
    found = shutil.which(engine)
    if found is None:
        raise EngineMissing(
            f'{engine} is not installed: a rollout with an "image" runs in a container of '
            f"it. Install it (as root: apt-get install podman runc) or run scripts/setup.sh"
        )
    if engine == "podman":
        return [found, "--runtime", "runc"]
    return [found]


def engine_env(engine: str = "podman") -> dict[str, str]:
    """The environment an engine call runs with: the host's, with podman's configuration
    file agenttap's own."""
    env = dict(os.environ)
    if engine == "podman":
        env["CONTAINERS_CONF"] = str(containers_conf())
    return env
