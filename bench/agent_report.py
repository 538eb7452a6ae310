"""bench/agent_sessions.py's report: the markdown tables of latency per turn bucket, time to
first token, wall time per session, CPU per call over turns and proxy load, every ratio
against vLLM's own chat endpoint."""

from __future__ import annotations

import math
import statistics

from bench.agent_paths import PROXIED, Call
from bench.agent_run import Results
from bench.common import pct

BUCKETS = ((1, 10), (11, 30), (31, 60), (61, 10**9))


def fmt(v: float, digits: int = 1) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def ratio(v: float, ref: float) -> str:
    return "-" if math.isnan(v) or math.isnan(ref) or ref <= 0 else f"{v / ref:.2f}x"


def report(
    results: Results,
    names: list[str],
    turns: int,
    sessions: int,
    skipped: dict[str, str],
    procs_of: dict[str, int] | None = None,
) -> None:
    procs_of = procs_of or {}
    by_path: dict[str, list[Call]] = {n: [c for c in results.calls if c.path == n] for n in names}
    buckets = [(lo, min(hi, turns)) for lo, hi in BUCKETS if lo <= turns]
    print(f"\n### Latency per call, ms (p50 / p95; x: p50 / chat's p50), {sessions} session(s)\n")
    head = "| path |"
    rule = "|---|"
    for lo, hi in buckets:
        tokens = [c.prompt_tokens for c in by_path.get("chat", []) if lo <= c.turn <= hi]
        size = f" (~{statistics.mean(tokens) / 1000:.1f}k)" if tokens else ""
        head += f" turns {lo}-{hi}{size} p50 | p95 | x |"
        rule += "---:|---:|---:|"
    print(head)
    print(rule)
    ref = {
        b: pct([c.ms for c in by_path.get("chat", []) if b[0] <= c.turn <= b[1]], 0.5)
        for b in buckets
    }
    for name in names + list(skipped):
        line = f"| {name} |"
        for b in buckets:
            if name in skipped:
                line += " n/a | | |"
                continue
            ms = [c.ms for c in by_path[name] if b[0] <= c.turn <= b[1]]
            p50, p95 = pct(ms, 0.5), pct(ms, 0.95)
            line += f" {fmt(p50)} | {fmt(p95)} | {ratio(p50, ref[b])} |"
        print(line)

    print(
        "\n### Time to first token, wall time per session, CPU per call "
        "(x: / chat's; wall: the sum of a session's calls; CPU ms per call, /proc/PID/stat: "
        "the proxy's own process(es), vLLM's API server process (its front end: template, "
        "tokenizer, detokenizer, HTTP), all of vLLM (its engine polls while it waits))\n"
    )
    print(
        "| path | TTFT p50 ms | p95 | x | wall s per session | x | proxy CPU ms/call "
        "| vLLM front CPU ms/call | x | vLLM all CPU ms/call | calls | not as asked |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    chat = by_path.get("chat", [])
    ref_ttft = pct([c.ttft_ms for c in chat], 0.5)
    walls = {n: session_walls(by_path[n]) for n in names}
    ref_wall = statistics.mean(walls["chat"]) if walls.get("chat") else math.nan

    def per_call(cpu: dict[tuple[str, int], float], name: str) -> float:
        if not cpu:
            return math.nan
        return sum(v for (p, _), v in cpu.items() if p == name) * 1000 / max(1, calls_of[name])

    calls_of = {n: len(by_path[n]) for n in names}
    ref_front = per_call(results.vllm_front, "chat")
    for name in names:
        calls = by_path[name]
        ttft = [c.ttft_ms for c in calls]
        wall = statistics.mean(walls[name]) if walls[name] else math.nan
        proxy = per_call(results.proxy_cpu, name)
        front = per_call(results.vllm_front, name)
        bad = len(results.failures.get(name, []))
        print(
            f"| {name} | {fmt(pct(ttft, 0.5))} | {fmt(pct(ttft, 0.95))} | "
            f"{ratio(pct(ttft, 0.5), ref_ttft)} | {fmt(wall, 2)} | {ratio(wall, ref_wall)} | "
            f"{fmt(proxy) if name in PROXIED else '-'} | {fmt(front)} | "
            f"{ratio(front, ref_front)} | {fmt(per_call(results.vllm_cpu, name))} | "
            f"{len(calls)} | {bad} |"
        )
    for name, why in skipped.items():
        print(f"| {name} | n/a | | | | | | | | | | ({why}) |")

    proxied = [n for n in names if n in PROXIED]
    if proxied:
        marks = sorted({t for t in (1, 2, 5, 10, 20, 30, 40, 50, 60, turns) if t <= turns})
        print(
            "\n### Proxy CPU per call over turns, ms (the scheduler's count, schedstat; mean of "
            "the turn's calls; last / turn 5: the median of the last five turns' over that of "
            "turns 3-7; trend: the Theil-Sen line through turns 2 to the last, its value at the "
            "last turn over its value at turn 5: a spike in one turn moves it little)\n"
        )
        print(
            "| path | "
            + " | ".join(f"turn {t}" for t in marks)
            + f" | last / turn 5 | trend, turn {turns} / turn 5 |"
        )
        print("|---|" + "---:|" * (len(marks) + 2))
        for name in proxied:
            per = {
                t: results.proxy_cpu_fine[(name, t)] * 1000 / max(1, calls_at(by_path[name], t))
                for t in range(1, turns + 1)
                if (name, t) in results.proxy_cpu_fine
            }
            early = [per[t] for t in range(3, 8) if t in per]
            late = [per[t] for t in range(turns - 4, turns + 1) if t in per]
            curve = " | ".join(fmt(per.get(t, math.nan)) for t in marks)
            # (Under 12 turns the two windows overlap: no ratio.)
            enough = turns >= 12 and early and late
            r = ratio(statistics.median(late), statistics.median(early)) if enough else "-"
            trend = (
                trend_ratio({t: v for t, v in per.items() if t >= 2}, 5, turns) if enough else None
            )
            shown = f"{trend:.2f}x" if trend is not None else "-"
            print(f"| {name} | {curve} | {r} | {shown} |")
    if proxied:
        proxy_load(results, by_path, proxied, procs_of)
    for name, whys in results.failures.items():
        print(f"\n{name}: {len(whys)} call(s) not as asked; first: {whys[0]}")


def trend_ratio(points: dict[int, float], at_from: int, at_to: int) -> float | None:
    """The Theil-Sen line through ``points`` (turn -> CPU per call): the median of the slopes
    between every two turns, through the median of what is left. Its value at ``at_to`` over
    its value at ``at_from``: how the cost grows with the turns, where a turn or two that
    another process slowed (this machine's noise) barely moves it. None: too few points, or a
    line at or below zero at ``at_from``."""
    turns = sorted(points)
    if len(turns) < 3:
        return None
    slopes = [
        (points[b] - points[a]) / (b - a) for i, a in enumerate(turns) for b in turns[i + 1 :]
    ]
    slope = statistics.median(slopes)
    intercept = statistics.median(points[t] - slope * t for t in turns)
    start = intercept + slope * at_from
    if start <= 0:
        return None
    return (intercept + slope * at_to) / start


def proxy_load(
    results: Results,
    by_path: dict[str, list[Call]],
    proxied: list[str],
    procs_of: dict[str, int],
) -> None:
    """Where one proxy process saturates: how busy each process was while its path's calls ran
    (CPU seconds over wall seconds, per process: 100% is one core, all a Python process can use)
    and how many calls per second its CPU per call allows it at most."""
    print(
        "\n### Proxy load (busy: CPU over the wall time of the path's calls, per process, "
        "100% = one core; bound: calls/s one process carries at its CPU per call, were it alone on a core)\n"
    )
    print("| path | processes | calls/s served | busy, mean | busy, busiest turn | bound calls/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in proxied:
        turns = [t for (p, t) in results.window if p == name]
        wall = sum(results.window[(name, t)] for t in turns)
        cpu = sum(results.proxy_cpu_fine.get((name, t), 0.0) for t in turns)
        n = max(1, procs_of.get(name, 1))
        calls = len(by_path[name])
        if not wall or not calls:
            continue
        busiest = max(
            results.proxy_cpu_fine.get((name, t), 0.0) / results.window[(name, t)]
            for t in turns
            if results.window[(name, t)] > 0
        )
        per_call = cpu / calls
        bound = 1 / per_call if per_call > 0 else math.nan
        print(
            f"| {name} | {n} | {calls / wall:.1f} | {100 * cpu / wall / n:.0f}% | "
            f"{100 * busiest / n:.0f}% | {fmt(bound)} |"
        )


def calls_at(calls: list[Call], turn: int) -> int:
    return sum(1 for c in calls if c.turn == turn)


def session_walls(calls: list[Call]) -> list[float]:
    """Each session's wall time on a path: the sum of its calls, seconds."""
    walls: dict[int, float] = {}
    for c in calls:
        walls[c.session] = walls.get(c.session, 0.0) + c.ms / 1000
    return list(walls.values())
