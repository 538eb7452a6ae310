"""Container images, built once per machine and cached by content: ``base_image`` (a Debian
root filesystem from ``mmdebstrap``, ``podman import``-ed, for machines that reach no registry)
and ``build_image`` (``podman build`` of a context, tagged by the hash of everything the build
reads: the context's files, the Containerfile, the build args and the ids of the ``localhost/``
images its FROM lines name). A build holds a file lock, so two test workers or two proxies never
build the same image at once; ``image_exists`` and ``image_workdir`` answer what a run needs.

Every engine call goes through ``podman.engine_command`` and ``podman.engine_env``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from capture.isolation.podman import engine_command, engine_env, ulimits

BASE_NAME = "agenttap-base"
TASK_REPO = "localhost/agenttap-task"
# Part of the base's hash: a change to how a base is made (the import's settings) rebuilds it.
_BASE_RECIPE = (
    "minbase",
    'CMD ["/bin/bash"]',
    "ENV LANG=C.UTF-8",
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
)
_TAIL_LINES = 25
# What this process really built (not a cache hit), by kind: "base" and "build". The bench and
# the tests read it to tell a cache hit from a build.
built: Counter[str] = Counter()


class ImageError(RuntimeError):
    """An image could not be made: what failed, and what to do, in words for the caller."""


class MmdebstrapMissing(ImageError):
    """mmdebstrap, which makes a base image from Debian's packages, is not installed."""


class BuildFailed(ImageError):
    """``podman build`` failed: the message holds the Containerfile's path and its last lines."""


def cache_dir() -> Path:
    """Where the build locks (and a base's root filesystem, while it is made) live:
    ``AGENTTAP_IMAGE_CACHE``, else ``~/.cache/agenttap/images``, else the temp folder."""
    configured = os.environ.get("AGENTTAP_IMAGE_CACHE")
    candidates = [Path(configured)] if configured else []
    candidates.append(Path.home() / ".cache" / "agenttap" / "images")
    candidates.append(Path(tempfile.gettempdir()) / f"agenttap-images-{os.geteuid()}")
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise ImageError(f"no writable image cache folder among {', '.join(map(str, candidates))}")


@contextmanager
def _locked(key: str) -> Iterator[None]:
    """Hold an exclusive lock named ``key`` across processes (released when the holder dies)."""
    with open(cache_dir() / f"{key}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _engine(
    engine: str, *args: str, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """One engine call, stdout and stderr merged; never raises on its exit status."""
    return subprocess.run(
        [*engine_command(engine), *args],
        env=engine_env(engine),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )


# podman's own processes (conmon) run with nproc 32768 here, and a container asking for more
# fails "error setting rlimit type 6: operation not permitted" even below the caller's hard
# limit (96365 here): measured, 32768 starts and 32769 does not.
_NPROC_CEILING = 32768


def ulimit_args(engine: str = "podman") -> list[str]:
    """The ``--ulimit`` flags a ``podman build`` or ``run`` needs on a host without
    ``CAP_SYS_RESOURCE``: podman.ulimits(), nproc capped at what podman's own processes hold."""
    if engine != "podman":
        return []
    nofile, nproc = ulimits()
    nproc = min(nproc, _NPROC_CEILING)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def _tail(output: str) -> str:
    return "\n".join(output.rstrip().splitlines()[-_TAIL_LINES:])


def image_exists(ref: str, engine: str = "podman") -> bool:
    """Whether ``ref`` is in the engine's local storage (nothing is pulled)."""
    if engine == "podman":
        return _engine(engine, "image", "exists", ref).returncode == 0
    return _engine(engine, "image", "inspect", ref).returncode == 0


def image_id(ref: str, engine: str = "podman") -> str | None:
    """The full id of the local image ``ref``, None when there is none."""
    done = _engine(engine, "image", "inspect", "--format", "{{.Id}}", ref)
    return done.stdout.strip() if done.returncode == 0 else None


def image_workdir(ref: str, engine: str = "podman") -> str:
    """The image's WORKDIR, "/" when it sets none."""
    done = _engine(engine, "image", "inspect", "--format", "{{.Config.WorkingDir}}", ref)
    if done.returncode != 0:
        raise ImageError(f"image {ref} is not in {engine}'s local storage: {_tail(done.stdout)}")
    return done.stdout.strip() or "/"


def _short(hexdigest: str) -> str:
    return hexdigest[:12]


# ---------------------------------------------------------------- the base image (mmdebstrap)


def apt_sources_text(root: Path = Path("/")) -> str:
    """The host's apt sources, every file apt reads, in order: mmdebstrap takes the mirror from
    them, so they are part of what a base holds."""
    apt = root / "etc" / "apt"
    files = [apt / "sources.list"]
    listed = apt / "sources.list.d"
    if listed.is_dir():
        files += sorted(p for p in listed.iterdir() if p.suffix in (".list", ".sources"))
    return "".join(f"# {p.name}\n{p.read_text()}" for p in files if p.is_file())


def base_key(suite: str, packages: Sequence[str], sources: str, mmdebstrap_version: str) -> str:
    """The base's content tag: 12 hex of what its root filesystem is made from."""
    payload = [suite, sorted(set(packages)), sources, mmdebstrap_version, list(_BASE_RECIPE)]
    return _short(hashlib.sha256(json.dumps(payload).encode()).hexdigest())


def _mmdebstrap() -> str:
    found = shutil.which("mmdebstrap")
    if found is None:
        raise MmdebstrapMissing(
            "mmdebstrap is not installed: agenttap makes its base images from Debian's packages "
            "with it where no image registry is reachable. Install it (as root: apt-get install "
            "mmdebstrap) or run scripts/setup.sh"
        )
    return found


def base_image(
    name: str = BASE_NAME,
    suite: str = "bookworm",
    packages: Sequence[str] = ("python3", "git"),
    engine: str = "podman",
) -> str:
    """A Debian ``suite`` minbase image with ``packages``, as ``localhost/NAME:<content tag>``
    (also tagged ``localhost/NAME:SUITE``, the name a Containerfile's FROM can use). Made once
    per machine: a second call with the same inputs only checks the tag exists."""
    engine_command(engine)  # EngineMissing before anything slow
    tool = _mmdebstrap()
    version = subprocess.run(
        [tool, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    tag = base_key(suite, packages, apt_sources_text(), version)
    ref = f"localhost/{name}:{tag}"
    if not image_exists(ref, engine):
        with _locked(f"base-{name}-{tag}"):
            if not image_exists(ref, engine):
                _make_base(tool, ref, suite, packages, engine)
    alias = f"localhost/{name}:{suite}"
    if image_id(alias, engine) != image_id(ref, engine):
        done = _engine(engine, "tag", ref, alias)
        if done.returncode != 0:
            raise ImageError(f"tagging {ref} as {alias} failed: {_tail(done.stdout)}")
    return ref


def _make_base(tool: str, ref: str, suite: str, packages: Sequence[str], engine: str) -> None:
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="rootfs-") as scratch:
        rootfs = Path(scratch) / "rootfs.tar"
        argv = [tool, "--variant=minbase", f"--include={','.join(sorted(set(packages)))}"]
        argv += ["--quiet", suite, str(rootfs)]
        done = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
        )
        if done.returncode != 0:
            raise ImageError(
                f"mmdebstrap could not make the {suite} base with {', '.join(packages)} "
                f"(exit {done.returncode}); are the packages' names right and Debian's "
                f"mirror reachable? Its last lines:\n{_tail(done.stdout)}"
            )
        changes = [arg for change in _BASE_RECIPE[1:] for arg in ("--change", change)]
        done = _engine(engine, "import", *changes, str(rootfs), ref)
        if done.returncode != 0:
            raise ImageError(f"{engine} import of {rootfs} as {ref} failed: {_tail(done.stdout)}")
    built["base"] += 1


# ---------------------------------------------------------------- task images (podman build)


def default_containerfile(context: Path) -> Path:
    """``Containerfile``, else ``Dockerfile``, in ``context``."""
    for name in ("Containerfile", "Dockerfile"):
        if (context / name).is_file():
            return context / name
    raise ImageError(f"{context} holds no Containerfile or Dockerfile: say which file builds it")


_FROM = re.compile(r"^\s*FROM\s+(.+)$", re.IGNORECASE | re.MULTILINE)
_ARG = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?\s*$", re.IGNORECASE)
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def from_refs(containerfile_text: str, build_args: Mapping[str, str] | None = None) -> list[str]:
    """The images the FROM lines name, ``${ARG}`` resolved from the build args and the ARG
    defaults declared before the first FROM; a stage's own name (``FROM build``) is left out."""
    args = dict(build_args or {})
    defaults: dict[str, str] = {}
    for line in containerfile_text.splitlines():
        if re.match(r"^\s*FROM\s", line, re.IGNORECASE):
            break
        match = _ARG.match(line)
        if match and match.group(2) is not None:
            defaults[match.group(1)] = match.group(2).strip("\"'")
    values = {**defaults, **args}

    def resolve(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        return values.get(name) or (match.group(2) or "")

    refs: list[str] = []
    stages: set[str] = set()
    for match in _FROM.finditer(containerfile_text):
        words = [w for w in match.group(1).split() if not w.startswith("--")]
        if not words:
            continue
        ref = _VAR.sub(resolve, words[0])
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
        if ref.lower() not in stages:
            refs.append(ref)
    return refs


def context_hash(
    context: Path,
    containerfile: Path,
    build_args: Mapping[str, str] | None = None,
    base_ids: Mapping[str, str | None] | None = None,
) -> str:
    """12 hex over everything a build reads: each path's relative name, kind, mode and bytes
    (a link's target), the Containerfile's bytes, the build args and the named images' ids."""
    digest = hashlib.sha256()

    def feed(*parts: str | bytes) -> None:
        for part in parts:
            data = part.encode() if isinstance(part, str) else part
            digest.update(len(data).to_bytes(8, "big"))
            digest.update(data)

    for path in sorted(context.rglob("*"), key=lambda p: p.relative_to(context).as_posix()):
        info = path.lstat()
        name = path.relative_to(context).as_posix()
        mode = f"{stat.S_IMODE(info.st_mode):o}"
        if stat.S_ISLNK(info.st_mode):
            feed("link", name, mode, os.readlink(path))
        elif stat.S_ISDIR(info.st_mode):
            feed("dir", name, mode)
        elif stat.S_ISREG(info.st_mode):
            feed("file", name, mode, path.read_bytes())
    feed("containerfile", containerfile.read_bytes())
    feed("args", json.dumps(sorted((build_args or {}).items())))
    feed("bases", json.dumps(sorted((base_ids or {}).items(), key=lambda kv: kv[0])))
    return _short(digest.hexdigest())


def _plan(
    context: Path, containerfile: Path | None, build_args: Mapping[str, str] | None, engine: str
) -> tuple[Path, Path, dict[str, str], str]:
    engine_command(engine)
    context = Path(context).resolve()
    if not context.is_dir():
        raise ImageError(f"build context {context} is not a folder")
    file = Path(containerfile).resolve() if containerfile else default_containerfile(context)
    args = {str(k): str(v) for k, v in (build_args or {}).items()}
    local = [r for r in from_refs(file.read_text(), args) if r.startswith("localhost/")]
    base_ids = {ref: image_id(ref, engine) for ref in local}
    missing = [ref for ref, found in base_ids.items() if found is None]
    if missing:
        raise BuildFailed(
            f"{file} builds FROM {', '.join(missing)}, which is not in {engine}'s local storage: "
            f"build it first (capture.isolation.images.base_image makes localhost/{BASE_NAME})"
        )
    return context, file, args, f"{TASK_REPO}:{context_hash(context, file, args, base_ids)}"


def planned_ref(
    context: Path,
    containerfile: Path | None = None,
    build_args: Mapping[str, str] | None = None,
    engine: str = "podman",
) -> str:
    """The ref ``build_image`` gives these inputs, without building (``image_exists`` of it
    says whether a build would be a cache hit)."""
    return _plan(context, containerfile, build_args, engine)[3]


def build_image(
    context: Path,
    containerfile: Path | None = None,
    build_args: Mapping[str, str] | None = None,
    engine: str = "podman",
    timeout: float | None = None,
) -> str:
    """``podman build`` of ``context`` as ``localhost/agenttap-task:<context hash>``; skipped
    when that tag exists. ``timeout`` (seconds) bounds the build (Harbor's
    ``build_timeout_sec``)."""
    context, file, args, ref = _plan(context, containerfile, build_args, engine)
    if image_exists(ref, engine):
        return ref
    with _locked(f"build-{ref.rsplit(':', 1)[1]}"):
        if image_exists(ref, engine):
            return ref
        argv = ["build", "--file", str(file), "--tag", ref, *ulimit_args(engine)]
        for key, value in sorted(args.items()):
            argv += ["--build-arg", f"{key}={value}"]
        try:
            done = _engine(engine, *argv, str(context), timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            out = expired.output
            text = out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
            raise BuildFailed(
                f"building {file} ran past its {timeout} s build timeout; its last lines:\n"
                f"{_tail(text)}"
            ) from None
        if done.returncode != 0:
            raise BuildFailed(
                f"building {file} failed (exit {done.returncode}); its last lines:\n"
                f"{_tail(done.stdout)}"
            )
        built["build"] += 1
    return ref
