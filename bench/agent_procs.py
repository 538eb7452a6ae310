"""bench/agent_sessions.py's processes: the no-EOS copy of the tiny policy, CPU time to the
nanosecond, and the peers it starts (the rLLM gateway, LiteLLM's proxy, a streaming mitmdump)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.common import free_port, peers_env, start_litellm

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / ".venv-peers"


# -- processes ------------------------------------------------------------------------------------
def no_eos_model(model_dir: Path, out: Path) -> Path:
    """A copy of the tiny policy whose EOS tokens get the rare tokens' negative bias instead of
    a positive one (scripts/build_tiny_model.py), so that every reply runs to ``max_tokens``
    on every wire format (Anthropic's and Responses' have no ``ignore_eos``); built once."""
    if (out / "config.json").exists():
        return out
    from safetensors.numpy import load_file, save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp)
    weights = load_file(str(model_dir / "model.safetensors"))
    gen = orjson.loads((model_dir / "generation_config.json").read_bytes())
    eos = gen.get("eos_token_id")
    head = weights["lm_head.weight"].copy()
    for token in [eos] if isinstance(eos, int) else list(eos or []):
        head[token, :] = 0.0
        head[token, 0] = -4.0  # as the special and rare tokens: never sampled
    weights["lm_head.weight"] = head
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(out)
    return out


def cpu_precise(pid: int) -> float:
    """CPU seconds of ``pid``'s living threads and descendants, to the nanosecond (the
    scheduler's ``/proc/PID/task/TID/schedstat``): /proc/PID/stat counts 10 ms ticks, too
    coarse for one turn's calls; a thread that has ended is not counted here (the run's totals
    come from /proc/PID/stat)."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
                children = (task / "children").read_text().split()
            except (OSError, ValueError, IndexError):
                continue
            for child in children:
                total += round(cpu_precise(int(child)) * 1e9)
    except OSError:
        pass
    return total / 1e9


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        """SIGTERM to its process group (each runs in one of its own), SIGKILL after 20 s."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


def spawn(name: str, cmd: list[str], work: Path, env: dict[str, str] | None = None) -> Proc:
    log = work / f"{name}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=work, env=env, start_new_session=True
        )
    return Proc(name, proc, log)


def wait_http(url: str, proc: Proc, timeout: float, ok: Callable[[int], bool]) -> None:
    """Until ``url`` answers with a status ``ok`` accepts (RuntimeError if ``proc`` exits or
    the time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            tail = proc.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}): {tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if ok(resp.status):
                    return
        except urllib.error.HTTPError as exc:
            if ok(exc.code):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{proc.name} did not answer at {url} in {timeout:.0f} s; see {proc.log}")


def start_rllm(vllm_url: str, work: Path) -> tuple[Proc, str]:
    python = PEERS / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"{python} missing: run scripts/setup_peers.sh")
    port = free_port()
    cmd = [
        str(python), "-m", "rllm_model_gateway", "--worker", f"{vllm_url}/v1",
        "--host", "127.0.0.1", "--port", str(port),
        "--db-path", str(work / "rllm-traces.db"), "--log-level", "warning",
    ]  # fmt: skip
    proc = spawn("rllm", cmd, work, peers_env())
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, 120, lambda s: s == 200)
    return proc, url


def start_litellm_peer(config: str, work: Path) -> tuple[Proc, str]:
    """LiteLLM's proxy from .venv-peers with ``config`` (common.litellm_config), once it
    answers: (its process, its URL); stopped again if it does not."""
    exe = PEERS / "bin" / "litellm"
    if not exe.exists():
        raise RuntimeError(f"{exe} missing: run scripts/setup_peers.sh")
    popen, port, log = start_litellm(exe, config, work, new_session=True)
    proc = Proc("litellm", popen, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health/liveliness", proc, 300, lambda s: s == 200)
    except RuntimeError:
        proc.stop()
        raise
    return proc, url


def start_mitmdump_s(vllm_url: str, work: Path, confdir: Path) -> tuple[Proc, str]:
    port = free_port()
    cmd = [
        str(REPO / ".venv" / "bin" / "mitmdump"),
        "--listen-host", "127.0.0.1", "--listen-port", str(port),
        "--set", f"confdir={confdir}", "--set", "connection_strategy=lazy",
        "--map-remote", f"|https://api.openai.com|{vllm_url}",
        "-s", str(REPO / "bench" / "stream_responses.py"),
    ]  # fmt: skip
    proc = spawn("mitmdump-s", cmd, work)
    deadline = time.monotonic() + 60
    import socket

    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"mitmdump-s exited: {proc.log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.2)
    raise RuntimeError("mitmdump-s did not listen")
