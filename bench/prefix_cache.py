"""A group's prompts and vLLM's prefix cache (issue 51 item 1): how much of a GRPO group's
prompts vLLM finds cached when every agent sees its folders at fixed places
(``agenttap_sandbox_paths=fixed``, the default) against at their host paths (``host``).

    .venv/bin/python bench/prefix_cache.py [--n 8] [--groups 2] [--max-tokens 16]

One real vLLM (the tiny fp32 Qwen3, ``--enable-prefix-caching``); per mode one agenttap
(``AgentTap.start``) and ``--groups`` groups of ``--n`` Claude Code rollouts (the pinned CLI, bwrap
sandbox, one model call each, answers capped at ``--max-tokens``) on one task, a seed folder
copied for each agent. Claude Code's system prompt names its working folder. vLLM's prefix cache
is emptied before each mode (``POST /reset_prefix_cache``); the table gives, per mode, how many
distinct first prompts the agents sent, the prompt tokens vLLM looked up in its cache and found
there (``vllm:prefix_cache_queries`` / ``_hits``, read from ``/metrics`` before and after), the
hit rate and its ratio to ``host`` in the same run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from capture.client.launcher import AgentTap  # noqa: E402
from capture.rollouts.agents import claude_code_capped  # noqa: E402
from capture.train.rows import main_row, split_row  # noqa: E402
from policy_server import launcher as policy_server  # noqa: E402
from tests.support.paths import QWEN3  # noqa: E402

TASK = "Write the word hello into a file named answer.txt."
METRIC = re.compile(r"^(vllm:prefix_cache_(?:queries|hits))_total(?:\{[^}]*\})? ([0-9.e+]+)$")


def cache_counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens), summed over its engines."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found = {"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0}
    for line in text.splitlines():
        match = METRIC.match(line)
        if match:
            found[match.group(1)] += float(match.group(2))
    return found


def reset_cache(url: str) -> None:
    request = urllib.request.Request(f"{url}/reset_prefix_cache", b"", method="POST")
    with urllib.request.urlopen(request, timeout=60):
        pass


def first_prompts(group: dict[str, Any]) -> list[tuple[int, ...]]:
    """Each agent's first call's prompt ids (its main row before the policy's first token)."""
    prompts = []
    for run in group["rollouts"]:
        row = main_row(run.get("rows") or [])
        if row is not None:
            prompts.append(tuple(split_row(row).prompt_ids))
    return prompts


def run_mode(
    mode: str, url: str, work: Path, seed: Path, args: argparse.Namespace
) -> dict[str, Any]:
    reset_cache(url)
    agent = claude_code_capped(args.max_tokens)
    with AgentTap.start(
        url, tokenizer=QWEN3, out=work / f"out-{mode}",
        options={"agenttap_sandbox_paths": mode},
    ) as tap:  # fmt: skip
        before = cache_counters(url)
        started = time.monotonic()
        prompts: list[tuple[int, ...]] = []
        statuses: list[str] = []
        for g in range(args.groups):
            group = tap.rollout(
                agent, TASK, n=args.n, workdir=seed, id=f"{mode}-{g}", seed=g,
                limits={"max_calls": 1}, timeout_s=600,
            )  # fmt: skip
            prompts += first_prompts(group)
            statuses += [r["status"] for r in group["rollouts"]]
        seconds = time.monotonic() - started
        after = cache_counters(url)
    queries = after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"]
    hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
    return {
        "mode": mode,
        "agents": len(statuses),
        "ok": statuses.count("ok"),
        "distinct": len(set(prompts)),
        "prompt_tokens": sum(map(len, prompts)) / len(prompts) if prompts else float("nan"),
        "queries": queries,
        "hits": hits,
        "rate": hits / queries if queries else float("nan"),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8, help="agents per group")
    parser.add_argument("--groups", type=int, default=2, help="groups per mode")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="agenttap-prefix-cache-"))
    seed = work / "task"
    seed.mkdir()
    (seed / "README.md").write_text("A task folder.\n")
    model_dir = policy_server.ensure_tiny_model(tokenizer=QWEN3)
    port = policy_server.free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"starting vLLM at {url} (about a minute on a CPU) ...", flush=True)
    vllm = policy_server.start_vllm(
        model_dir, port, log_path=work / "vllm.log", extra_args=["--enable-prefix-caching"]
    )
    try:
        policy_server.wait_ready(url, vllm, timeout_s=900, log_path=work / "vllm.log")
        rows = [run_mode(mode, url, work, seed, args) for mode in ("host", "fixed")]
    finally:
        policy_server.stop(vllm)
    base = rows[0]["rate"]
    print(f"\n{args.groups} groups of {args.n} Claude Code agents, one call each, per mode")
    print(
        f"{'mode':<6} {'agents':>6} {'ok':>3} {'distinct prompts':>16} {'prompt tokens':>13} "
        f"{'cache queries':>13} {'cache hits':>10} {'hit rate':>8} {'x host':>6} {'s':>6}"
    )
    for r in rows:
        print(
            f"{r['mode']:<6} {r['agents']:>6} {r['ok']:>3} {r['distinct']:>16} "
            f"{r['prompt_tokens']:>13.0f} {r['queries']:>13.0f} {r['hits']:>10.0f} "
            f"{r['rate']:>8.3f} {r['rate'] / base if base else float('nan'):>6.2f} "
            f"{r['seconds']:>6.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
