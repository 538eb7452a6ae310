"""What a run in a task's container image costs against the bwrap sandbox beside it: each
scaffold's start, and 16 runs at once, measured in one run (issue 49).

    .venv/bin/python bench/images.py [--reps 2] [--concurrency 16] [--agents claude-code,codex]
                                     [--task swe-slugify]

The isolation API directly (capture/isolation/box.py; no proxy, no network): a ``Box``, its
``podman`` engine running the image (the suite's test base, ``tests.support.task_images``,
built once and cached; ``--task`` a task's image on it) with the scaffold brought in from the
host through its loader, and its ``bwrap`` engine running the same command on the host.

Start: the time from ``Box.start`` to the scaffold's first line of stdout, for each named
agent's ``--version`` (mini-swe-agent has none: ``--help``; terminus-2: Harbor's Python
importing ``harbor``) and ``echo`` (the engine's floor). "Cold" is the first start of that
command in that engine in this process, just after the image was built or found cached: the
host's page cache may hold the image and the scaffold already (other runs read them). "Warm"
is the p50 of the next ``--reps`` starts, the engines interleaved. The container's phases (its
``create``, ``init``, then ``start`` to the first line, and its removal after the end) come
from timing ``Container``'s calls.

Concurrency: ``--concurrency`` runs of ``python3 -c 'import time; time.sleep(2)'`` started at
once, the image's Python in its containers and the host's ``/usr/bin/python3`` in bwrap: the
wall time until every one ended, the sum of their cgroups' ``memory_peak_bytes`` and the drop
of the host's MemAvailable (its lowest while they ran against before: other work on the host
moves it too), and the most PSS at once of the containers' host processes (each one's
``podman start --attach`` and conmon, outside its cgroup).

With ``--reps 3`` a run took 7 minutes on 2 cores at load 9, OpenHands' starts most of it;
the default (``--reps 2``) makes 6 starts per scaffold and engine instead of 8.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import pct  # noqa: E402
from capture.isolation.box import Box, BoxHandle, BoxSpec, Ended  # noqa: E402
from capture.isolation.containers import Container, ContainerPlan  # noqa: E402
from capture.isolation.engines import Engine  # noqa: E402
from capture.isolation.limits import MIB, SandboxLimits  # noqa: E402
from capture.isolation.output import OutputPump  # noqa: E402
from capture.rollouts.agents import AGENTS, config_home, prepare_home  # noqa: E402

ENGINES = ("podman", "bwrap")
# Each scaffold's quickest command that prints: its arguments after the agent's binary.
SCAFFOLD_ARGS: dict[str, list[str]] = {
    "claude-code": ["--version"],
    "codex": ["--version"],
    "gemini": ["--version"],
    "opencode": ["--version"],
    "mini-swe-agent": ["--help"],  # no --version: it exits 2 on it
    "openhands": ["--version"],
    "terminus-2": ["-c", "import harbor; print(harbor.__version__)"],
}
# Rows beside an agent's own: the same command with more environment. Gemini CLI relaunches
# itself (a bigger V8 heap) through node's process.execPath, which in a container is the
# host's loader that brought node in: it fails there; without the relaunch it does not.
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "gemini, GEMINI_CLI_NO_RELAUNCH": ("gemini", {"GEMINI_CLI_NO_RELAUNCH": "true"}),
}
ECHO = "echo"  # no scaffold: the engine's floor
SLEEP = "import time; time.sleep(2)"
SLEEP_S = 2.0
HOST_PYTHON = "/usr/bin/python3"
# In the command line of each of this bench's containers' host processes (capture/isolation/
# engines.py container_name of the run named "bench-podman").
CONTAINER_MARKER = b"agenttap-bench-podman-"
TIMEOUT_S = 180.0


# -- the numbers (pure: tests/unit/test_images_bench.py) -----------------------------------------
@dataclass
class Starts:
    """One command's starts in one engine: seconds to the first line, the cold one first."""

    times: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    failed: bool = False  # a start printed no line (the note says why)

    @property
    def cold(self) -> float:
        return self.times[0] if self.times and not self.failed else float("nan")

    @property
    def warm(self) -> float:
        return float("nan") if self.failed else pct(self.times[1:], 0.5)


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1e3:,.0f}"


def cells(starts: Starts) -> str:
    """An engine's cold and warm cells: ``failed`` for a command that printed no line there."""
    if starts.failed:
        return "failed | failed"
    return f"{ms(starts.cold)} | {ms(starts.warm)}"


def ratio(value: float, base: float) -> str:
    return "-" if value != value or base != base or base <= 0 else f"{value / base:.1f}x"


def start_table(rows: dict[str, dict[str, Starts]]) -> list[str]:
    """The start table: per command, cold and warm p50 in each engine and podman's warm p50
    over bwrap's."""
    lines = [
        "| scaffold | podman cold ms | podman warm p50 ms | bwrap cold ms | bwrap warm p50 ms "
        "| podman / bwrap warm | podman - bwrap warm ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, by in rows.items():
        pod, bw = by.get("podman", Starts()), by.get("bwrap", Starts())
        lines.append(
            f"| {name} | {cells(pod)} | {cells(bw)} "
            f"| {ratio(pod.warm, bw.warm)} | {ms(pod.warm - bw.warm)} |"
        )
    return lines


def phase_table(rows: dict[str, dict[str, Starts]]) -> list[str]:
    """Where a container's start goes, cold / warm p50: ``create``, ``init``, the rest to the
    first line, and its removal after the run ended."""
    keys = ("create", "init", "first_line", "remove")
    lines = [
        "| scaffold | create ms | init ms | start to first line ms | remove after ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, by in rows.items():
        pod = by.get("podman")
        if pod is None or pod.failed or not pod.times:
            continue
        cells = []
        for key in keys:
            values = pod.phases.get(key, [])
            cold = values[0] if values else float("nan")
            cells.append(f"{ms(cold)} / {ms(pct(values[1:], 0.5))}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


@dataclass
class Crowd:
    """``--concurrency`` runs started at once in one engine."""

    engine: str
    wall_s: float
    ok: int
    runs: int
    peaks: list[float]
    available_drop: float
    helpers_pss: float = 0.0  # the engine's host processes outside the runs' cgroups, at most


def crowd_table(crowds: list[Crowd]) -> list[str]:
    """The concurrency table, each engine's wall and memory beside bwrap's."""
    base = next((c for c in crowds if c.engine == "bwrap"), None)
    lines = [
        "| engine | runs ok | wall s | over the 2 s sleep s | x bwrap wall | sum of peaks MiB "
        "| per run MiB | host helpers PSS MiB | MemAvailable drop MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in crowds:
        total = sum(c.peaks)
        per = total / len(c.peaks) if c.peaks else float("nan")
        lines.append(
            f"| {c.engine} | {c.ok}/{c.runs} | {c.wall_s:.2f} | {c.wall_s - SLEEP_S:.2f} "
            f"| {ratio(c.wall_s, base.wall_s) if base else '-'} | {total / MIB:,.0f} "
            f"| {per / MIB:,.1f} | {c.helpers_pss / MIB:,.0f} | {c.available_drop / MIB:,.0f} |"
        )
    return lines


def mem_available(meminfo: str) -> float:
    """MemAvailable in bytes from /proc/meminfo's text."""
    if "MemAvailable:" not in meminfo:
        raise ValueError("no MemAvailable line in /proc/meminfo")
    return kib_field(meminfo, "MemAvailable")


def kib_field(text: str, name: str) -> float:
    """A ``NAME:  N kB`` line's value in bytes (/proc/meminfo, smaps_rollup); 0 when absent."""
    for line in text.splitlines():
        if line.startswith(name + ":"):
            return float(line.split()[1]) * 1024
    return 0.0


def helpers_pss(marker: bytes) -> float:
    """The PSS of every process whose command line holds ``marker`` (a run's container's name:
    its ``podman start --attach`` and its conmon, which live outside its cgroup)."""
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if marker in Path(entry.path, "cmdline").read_bytes():
                total += kib_field(Path(entry.path, "smaps_rollup").read_text(), "Pss")
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return total


def usable_path(program: str) -> str:
    """``program`` with its folder's symlinks resolved, its own name kept (a venv's python
    finds its venv by the name it was called by): the engines show a program's real folder,
    so a path through a linked folder (a worktree's venv) is not there inside."""
    path = Path(program)
    return str(Path(os.path.realpath(path.parent)) / path.name)


# -- the runs ------------------------------------------------------------------------------------
class FirstLine(OutputPump):
    """The run's stdout pump, noting when its first line came."""

    def __init__(self, log_path: Path, cap_bytes: int) -> None:
        super().__init__(log_path, cap_bytes)
        self.at: float | None = None

    def _take(self, chunk: bytes, log: Any) -> None:
        if self.at is None and b"\n" in chunk:
            self.at = time.perf_counter()
        super()._take(chunk, log)


PHASES: dict[str, float] = {}


def timed(name: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``call`` noting its last duration in ``PHASES[name]`` (one start at a time)."""

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            PHASES[name] = time.perf_counter() - start

    return wrapper


def time_container_calls() -> None:
    """Each of ``Container``'s calls that a start and an end make, timed into ``PHASES``."""
    for name in ("create", "init", "remove"):
        raw = Container.__dict__[name]
        if isinstance(raw, classmethod):
            setattr(Container, name, classmethod(timed(name, raw.__func__)))
        else:
            setattr(Container, name, timed(name, raw))


class NoSessions:
    """The bindings of a box whose runs have no session (no network): never asked."""

    def bind(self, source: Any, destination: Any, session_id: str) -> None:
        raise AssertionError("a bench run has no session to bind")

    def unbind(self, source: Any, destination: Any) -> None:
        raise AssertionError("a bench run has no session to unbind")


@dataclass
class Run:
    start_s: float  # Box.start to the first line (nan: none)
    ended: Ended
    output: str


class Bench:
    def __init__(self, image: str, tmp: Path) -> None:
        self.image, self.tmp = image, tmp
        self.box = Box(
            hide=(), expose=(), routes=lambda: [], bindings=NoSessions(), max_connections=8,
            max_running=32,
        )  # fmt: skip
        self.engines: dict[str, Engine] = {e: self.box.make_engine(e) for e in ENGINES}
        self.count = 0

    def spec(
        self, engine: str, command: list[str], env: dict[str, str], from_host: bool, agent: str
    ) -> BoxSpec:
        self.count += 1
        folder = self.tmp / f"run{self.count}"
        work, home, tmpdir = folder / "work", folder / "home", folder / "tmp"
        for f in (work, home, tmpdir):
            f.mkdir(parents=True)
        env = {**env, "HOME": str(home), "TMPDIR": str(tmpdir)}
        if agent in AGENTS:
            prepare_home(agent, home)
            env.update(config_home(agent, home))
        self.engines[engine].hand_over(work, home, tmpdir)
        plan = ContainerPlan(image=self.image, from_host=from_host)
        return BoxSpec(
            name=f"bench-{engine}", engine=self.engines[engine], command=command, env=env,
            folders=(work, home, tmpdir), limits=SandboxLimits(), log=folder / "out.log",
            stderr_log=folder / "err.log", container=plan if engine == "podman" else None,
        )  # fmt: skip

    async def run(self, spec: BoxSpec) -> Run:
        start = time.perf_counter()
        handle: BoxHandle = await self.box.start(spec)
        pump = FirstLine(spec.log, handle.pump.cap_bytes)
        handle.pump = pump
        ended = await handle.wait(TIMEOUT_S, lambda: False)
        first = pump.at - start if pump.at is not None else float("nan")
        output = spec.log.read_text(errors="replace")
        if ended.exit_code != 0 or ended.timed_out or ended.limit:
            assert spec.stderr_log is not None
            output += spec.stderr_log.read_text(errors="replace")
        shutil.rmtree(spec.log.parent, ignore_errors=True)
        return Run(first, ended, output)

    async def close(self) -> None:
        await self.box.close()


def scaffold_command(name: str) -> tuple[list[str], dict[str, str]] | str:
    """The command and environment that start ``name`` (ECHO: none), or why it cannot."""
    if name == ECHO:
        return ["echo", "ok"], {}
    agent = AGENTS[name]
    try:
        program = agent.command("x")[0]
    except FileNotFoundError as e:
        return str(e)
    return [usable_path(program), *SCAFFOLD_ARGS[name]], dict(agent.env)


def rows_for(agents: list[str]) -> list[tuple[str, str, dict[str, str]]]:
    """The start table's rows: (label, scaffold, more environment), ``echo`` first, each
    agent's variants after it."""
    rows: list[tuple[str, str, dict[str, str]]] = [(ECHO, ECHO, {})]
    for agent in agents:
        rows.append((agent, agent, {}))
        rows += [(label, a, env) for label, (a, env) in VARIANTS.items() if a == agent]
    return rows


async def measure_starts(
    bench: Bench, agents: list[str], reps: int
) -> dict[str, dict[str, Starts]]:
    rows: dict[str, dict[str, Starts]] = {}
    for label, name, more_env in rows_for(agents):
        found = scaffold_command(name)
        if isinstance(found, str):
            print(f"note: {label} skipped: {found}", flush=True)
            continue
        command, agent_env = found
        env = {**agent_env, **more_env, "PATH": os.environ.get("PATH", os.defpath)}
        by = {e: Starts() for e in ENGINES}
        for i in range(reps + 1):
            # bwrap first on the cold start: the scaffold's own files are read from disk (if
            # ever) by it, and podman's cold start shows what the container adds.
            for engine in ENGINES if i % 2 else tuple(reversed(ENGINES)):
                if by[engine].failed:
                    continue  # once is enough: the note said why
                PHASES.clear()
                spec = bench.spec(engine, command, env, from_host=name != ECHO, agent=name)
                run = await bench.run(spec)
                if run.start_s != run.start_s:
                    by[engine].failed = True
                    print(
                        f"note: {label} in {engine} printed no line (exit {run.ended.exit_code}, "
                        f"limit {run.ended.limit}, timed out {run.ended.timed_out}): "
                        f"{run.output.strip()[-600:]!r}",
                        flush=True,
                    )
                    continue
                by[engine].times.append(run.start_s)
                if engine == "podman":
                    first_line = run.start_s - PHASES.get("create", 0) - PHASES.get("init", 0)
                    for key, value in (*PHASES.items(), ("first_line", first_line)):
                        by[engine].phases.setdefault(key, []).append(value)
        print(
            f"{label}: podman {[round(t, 3) for t in by['podman'].times]}, "
            f"bwrap {[round(t, 3) for t in by['bwrap'].times]}",
            flush=True,
        )
        rows[label] = by
    return rows


async def watch_memory(lowest: list[float], helpers: list[float], stop: asyncio.Event) -> None:
    """The lowest MemAvailable (every 20 ms) and the highest PSS of the containers' host
    processes (every 100 ms) until ``stop``."""
    tick = 0
    while not stop.is_set():
        lowest[0] = min(lowest[0], mem_available(Path("/proc/meminfo").read_text()))
        if tick % 5 == 0:
            helpers[0] = max(helpers[0], helpers_pss(CONTAINER_MARKER))
        tick += 1
        try:
            await asyncio.wait_for(stop.wait(), 0.02)
        except TimeoutError:
            pass


async def measure_crowd(bench: Bench, engine: str, n: int) -> Crowd:
    python = "python3" if engine == "podman" else HOST_PYTHON
    env = {"PATH": "/usr/bin:/bin"}
    specs = [bench.spec(engine, [python, "-c", SLEEP], env, False, "") for _ in range(n)]
    before = mem_available(Path("/proc/meminfo").read_text())
    lowest, helpers, stop = [before], [0.0], asyncio.Event()
    watcher = asyncio.ensure_future(watch_memory(lowest, helpers, stop))
    start = time.perf_counter()
    runs = await asyncio.gather(*(bench.run(s) for s in specs), return_exceptions=True)
    wall = time.perf_counter() - start
    stop.set()
    await watcher
    ok, peaks = 0, []
    for r in runs:
        if isinstance(r, BaseException):
            print(f"note: a {engine} run failed to start: {r!r}", flush=True)
            continue
        if r.ended.exit_code == 0 and not r.ended.limit and not r.ended.timed_out:
            ok += 1
        else:
            print(f"note: a {engine} run ended badly: {r.ended} {r.output[-400:]!r}", flush=True)
        peaks.append(float(r.ended.usage.get("memory_peak_bytes", 0)))
    return Crowd(engine, wall, ok, n, peaks, before - lowest[0], helpers[0])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--reps", type=int, default=2, help="warm starts per engine (after one cold)"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="runs at once (0: none)")
    parser.add_argument(
        "--agents", default=",".join(SCAFFOLD_ARGS), help="comma-separated scaffolds ('' : none)"
    )
    parser.add_argument("--task", help="a task's image (tests/fixtures/tasks/NAME) for the base")
    args = parser.parse_args(argv)
    args.agents = [a for a in args.agents.split(",") if a]
    unknown = [a for a in args.agents if a not in SCAFFOLD_ARGS]
    if unknown:
        parser.error(f"unknown agents {unknown}: pick from {', '.join(SCAFFOLD_ARGS)}")
    return args


async def amain(args: argparse.Namespace) -> None:
    from tests.support.task_images import suite_base, task_image

    print("load average at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    built = time.perf_counter()
    image = task_image(args.task) if args.task else suite_base()
    print(f"image {image} (built or found cached in {time.perf_counter() - built:.1f} s)")
    time_container_calls()
    tmp = Path(tempfile.mkdtemp(prefix="agenttap-bench-images-"))
    bench = Bench(image, tmp)
    try:
        rows = await measure_starts(bench, args.agents, args.reps)
        crowds = []
        if args.concurrency:
            for engine in ("bwrap", "podman"):
                crowds.append(await measure_crowd(bench, engine, args.concurrency))
    finally:
        await bench.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"\nStart to the first line: cold (1) and warm (p50 of {args.reps}), {image}\n")
    print("\n".join(start_table(rows)))
    print("\nThe container's start, phase by phase: cold / warm p50\n")
    print("\n".join(phase_table(rows)))
    if crowds:
        print(f"\n{args.concurrency} runs of `python3 -c '{SLEEP}'` started at once\n")
        print("\n".join(crowd_table(crowds)))


def main(argv: list[str] | None = None) -> None:
    asyncio.run(amain(parse(argv)))


if __name__ == "__main__":
    main()
