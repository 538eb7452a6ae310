"""The helpers several benches share: percentiles, a free port, a process's CPU time from /proc,
the vLLM-shaped stub policy served from a child process, and LiteLLM's proxy started in front
of a server.

Imported as ``bench.common``: each bench puts the repository on ``sys.path`` first, so this
works both for ``python bench/X.py`` and ``python -m bench.X``.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

# What every path is called with (LiteLLM's master key; the others take any).
API_KEY = "sk-bench-" + "0123456789abcdef" * 2

_TICK = os.sysconf("SC_CLK_TCK")


# -- numbers -------------------------------------------------------------------------------------
def pct(values: list[float], q: float, empty: float = math.nan) -> float:
    """The ``q`` quantile of ``values``, interpolated between the two nearest ranks; NaNs are
    left out, and no values at all give ``empty``."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return empty
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def rank_pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` as the value at rank ``int(n * q)``, no interpolation
    (the rule the control, sandbox, concurrency and Ray-pool benches report by)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# -- processes -----------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int, children: bool = True) -> float:
    """User + system CPU seconds of process ``pid`` (every thread) and, with ``children``,
    its living descendants, from /proc/PID/stat (0 for a process that is gone)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        if not children:
            return total
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += cpu_seconds(int(child))
    except (OSError, ValueError, IndexError):
        pass  # gone meanwhile
    return total


# -- the stub policy -----------------------------------------------------------------------------
class CachedTokenizer:
    """The stub's tokenizer with ``decode`` memoized: the stub decodes each answer token by
    token (quadratic in its length), work a real vLLM does not do per call."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self._decode = functools.lru_cache(maxsize=100_000)(self._decode_tuple)

    def _decode_tuple(self, ids: tuple[int, ...], skip: bool) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._decode(tuple(ids), skip_special_tokens)

    def __len__(self) -> int:  # dunders skip __getattr__ (the stub's /detokenize asks)
        return len(self._tok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def serve_stub(
    tokenizer: Path,
    reply: str,
    chunk_delay_s: float = 0.0,
    *,
    cached_decode: bool = False,
    conn: Any = None,
    dev_mode: bool = False,
) -> None:
    """The vLLM-shaped stub policy in this (child) process, answering ``reply`` with a chunk
    every ``chunk_delay_s``. Without ``conn``: prints its URL and serves until stdin closes;
    with a multiprocessing ``conn``: sends its URL there and serves until the pipe closes."""
    from tests.support.stub_vllm import StubPolicy

    stub = StubPolicy(str(tokenizer))
    stub.default_reply = reply
    stub.chunk_delay_s = chunk_delay_s
    stub.dev_mode = dev_mode  # vLLM's /pause and /resume
    if cached_decode:
        stub.tok = CachedTokenizer(stub.tok)  # type: ignore[assignment]
    url = stub.start()
    if conn is None:
        print(url, flush=True)
        sys.stdin.read()
    else:
        conn.send(url)
        try:
            conn.recv()
        except EOFError:
            pass
    stub.stop()


# -- LiteLLM's proxy -----------------------------------------------------------------------------
def litellm_config(
    model_name: str, model: str, api_base: str, api_key: str, drop_params: bool = False
) -> str:
    """LiteLLM proxy's config: one model ``model_name`` served by ``model`` (provider/name) at
    ``api_base``, keyed by ``API_KEY``, telemetry off."""
    return (
        "model_list:\n"
        f"  - model_name: {model_name}\n"
        "    litellm_params:\n"
        f"      model: {model}\n"
        f"      api_base: {api_base}\n"
        f"      api_key: {api_key}\n"
        "general_settings:\n"
        f"  master_key: {API_KEY}\n"
        "litellm_settings:\n"
        "  telemetry: false\n" + ("  drop_params: true\n" if drop_params else "")
    )


def peers_env() -> dict[str, str]:
    """This process's environment for a peer proxy: no HTTP(S) proxy of the bench's own, no
    fetch of LiteLLM's cost map (no internet), its log at errors only."""
    env = {k: v for k, v in os.environ.items() if k.upper() not in ("HTTPS_PROXY", "HTTP_PROXY")}
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    env["LITELLM_LOG"] = "ERROR"
    return env


def start_litellm(
    exe: Path, config: str, work: Path, *, new_session: bool
) -> tuple[subprocess.Popen[bytes], int, Path]:
    """LiteLLM's proxy (``exe``) with ``config`` written to WORK/litellm.yaml, one worker on a
    free port, its output in WORK/litellm.log: (process, port, log). The caller waits for it
    its own way; ``new_session`` puts it in a process group of its own (stopped by group)."""
    path = work / "litellm.yaml"
    path.write_text(config)
    port = free_port()
    log = work / "litellm.log"
    cmd = [
        str(exe), "--config", str(path), "--host", "127.0.0.1", "--port", str(port),
        "--num_workers", "1",
    ]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=peers_env(),
            cwd=work,
            start_new_session=new_session,
        )
    return proc, port, log
