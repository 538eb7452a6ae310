"""bench/agent_sessions.py's run: the paths' sessions called turn by turn (interleaved, each
path's sessions at once), the CPU of the proxies and of vLLM read around each path's calls."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from bench.agent_paths import Call, IdsPath, Path_
from bench.agent_plan import Plan
from bench.common import cpu_seconds


# -- the run -------------------------------------------------------------------------------------
@dataclass
class Results:
    calls: list[Call] = field(default_factory=list)
    # (path, turn) -> CPU seconds of the path's proxies / of vLLM during that turn's calls
    proxy_cpu: dict[tuple[str, int], float] = field(default_factory=dict)
    proxy_cpu_fine: dict[tuple[str, int], float] = field(default_factory=dict)  # schedstat
    vllm_cpu: dict[tuple[str, int], float] = field(default_factory=dict)
    # vLLM's API server process alone (its front end: chat template, tokenizer, detokenizer,
    # HTTP), without the engine's processes (which poll while idle, whoever calls)
    vllm_front: dict[tuple[str, int], float] = field(default_factory=dict)
    # (path, turn) -> seconds the path's calls of that turn took, first sent to last answered
    window: dict[tuple[str, int], float] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)


async def run_turns(
    paths: dict[str, Path_],
    plan: Plan,
    turns: int,
    vllm_pid: int | None,
    run_id: str,
    max_tokens: int,
) -> Results:
    import aiohttp

    results = Results()
    names = list(paths)
    sessions = len(plan.texts)
    for path in paths.values():
        path.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=900),
        )
        path.begin(plan, max_tokens)
    try:
        for turn in range(1, turns + 1):
            began = time.monotonic()
            order = names[(turn - 1) % len(names) :] + names[: (turn - 1) % len(names)]
            for name in order:
                path = paths[name]
                live = [s for s in range(sessions) if s not in path.failed]
                if not live:
                    continue
                if isinstance(path, IdsPath):
                    path.prepared = {
                        s: path.request(s, f"{run_id}-{name}-{s}") for s in live
                    }  # outside the clock
                    # What the loop could not see while rendering (connections the server
                    # closed meanwhile), seen before the calls.
                    await asyncio.sleep(0.05)
                cpu0 = path.cpu()
                t0 = time.monotonic()
                vcpu0 = cpu_seconds(vllm_pid) if vllm_pid else 0.0
                front0 = cpu_seconds(vllm_pid, children=False) if vllm_pid else 0.0
                outcomes = await asyncio.gather(
                    *(path.call(s, turn, f"{run_id}-{name}-{s}") for s in live),
                    return_exceptions=True,
                )
                cpu1 = path.cpu()
                results.window[(name, turn)] = time.monotonic() - t0
                results.proxy_cpu[(name, turn)] = cpu1[0] - cpu0[0]
                results.proxy_cpu_fine[(name, turn)] = cpu1[1] - cpu0[1]
                if vllm_pid:
                    results.vllm_cpu[(name, turn)] = cpu_seconds(vllm_pid) - vcpu0
                    results.vllm_front[(name, turn)] = (
                        cpu_seconds(vllm_pid, children=False) - front0
                    )
                for s, out in zip(live, outcomes, strict=True):
                    if isinstance(out, BaseException):
                        why = f"turn {turn}, session {s}: {type(out).__name__}: {out}"
                        path.failed[s] = why
                        results.failures.setdefault(name, []).append(why)
                        continue
                    if out.tokens != max_tokens:
                        why = f"turn {turn}, session {s}: {out.tokens} tokens, not {max_tokens}"
                        results.failures.setdefault(name, []).append(why)
                    results.calls.append(out)
            print(
                f"  turn {turn}/{turns}: {time.monotonic() - began:.1f} s "
                f"(prompt ~{prompt_at(results, turn)} tokens)",
                flush=True,
            )
    finally:
        for path in paths.values():
            await path.http.close()
    return results


def prompt_at(results: Results, turn: int) -> int:
    seen = [c.prompt_tokens for c in results.calls if c.turn == turn and c.path == "chat"]
    seen = seen or [c.prompt_tokens for c in results.calls if c.turn == turn]
    return int(statistics.mean(seen)) if seen else 0


async def warm_up(paths: dict[str, Path_], plan: Plan, max_tokens: int, run_id: str) -> None:
    """One call per path, not measured: the path's own first-call work, and the shared
    system prompt and tools into vLLM's prefix cache (every path's turn 1 then finds them)."""
    import aiohttp

    warm = Plan(plan.system, plan.tools, [[plan.texts[0][0][:400], "ok"]], 0, [[]])
    for name, path in paths.items():
        path.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        path.begin(warm, max_tokens)
        try:
            if isinstance(path, IdsPath):
                path.prepared = {0: path.request(0, f"{run_id}-warm-{name}")}
            out = await path.call(0, 1, f"{run_id}-warm-{name}")
            if out.tokens != max_tokens:
                raise RuntimeError(f"{out.tokens} tokens, not {max_tokens}")
        finally:
            await path.http.close()
