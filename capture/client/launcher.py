"""Start agenttap from a trainer's own Python process, and drive it.

    from capture.client.launcher import AgentTap

    with AgentTap.start(policy_url="http://127.0.0.1:8000", tokenizer="/models/qwen3",
                        out="rollouts") as tap:
        sess = tap.open_session(metadata={"task_id": "t1", "group_id": "g1", "split": "train"},
                                limits={"max_calls": 30, "deadline_s": 600})
        subprocess.run(["claude", "-p", task], env={**os.environ, **sess.env})  # proxy mode
        # or: OpenAI(base_url=sess.base_urls["openai"], api_key=sess.api_key)    # base-URL mode
        table = sess.close(reward=1.0)          # pyarrow.Table of its thread rows

mitmproxy keeps one master per interpreter, so each instance is a ``mitmdump`` child process
on free ports (the proxy's and the control API's), read back from its banner lines
(``AGENTTAP_PROXY=``, ``AGENTTAP_API=``, ``AGENTTAP_TOKEN=``, ``AGENTTAP_CA=``); any number of
instances run side by side and the trainer's code is the same for each. ``close`` stops the
child with SIGTERM, which writes every session's shards. ``AsyncAgentTap`` is the same for
asyncio code. The control API itself is plain HTTP (capture/control/api.py): other processes
and languages use it directly, ``ControlClient`` is its Python client.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from capture.client.control_client import AgentTapError, ControlClient

REPO = Path(__file__).resolve().parents[2]
ADDON = REPO / "addons" / "capture.py"

BANNER = re.compile(r"AGENTTAP_(PROXY|API|TOKEN|CA)=(\S+)")


@dataclass
class Session:
    """One rollout: hand ``env`` (proxy mode) or ``base_urls`` (base-URL mode) to the agent."""

    client: ControlClient
    id: str
    env: dict[str, str]
    base_urls: dict[str, str]
    # The session's secret: the API key base-URL clients send (``env`` has it as every key and
    # as the proxy password). A call of this session without it gets a 401.
    api_key: str = ""
    # Set by close: why it ended (stop, max_calls, max_tokens, deadline) and its metrics.
    end_reason: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def close(
        self, reward: float | dict[str, float] | None = None, reward_auxiliary: bool = False
    ) -> pa.Table:
        """Close the session and get its thread rows (reward, metadata, end_reason, metrics
        set) as a table; ``reward``: one number (set on the main and subagent rows, and on the
        auxiliary ones too with ``reward_auxiliary``), or one per thread id."""
        body: dict[str, Any] = {"reward": reward} if reward is not None else {}
        if reward_auxiliary:
            body["reward_auxiliary"] = True
        summary, table = self.client.request("POST", f"/sessions/{self.id}/close", body, arrow=True)
        self.end_reason = summary.get("end_reason")
        self.metrics = summary.get("metrics", {})
        assert table is not None
        return table

    def reward(self, reward: float | dict[str, float]) -> None:
        """A reward that arrives after close (a verifier that runs after the agent exits):
        readers see it joined to the rows."""
        self.client.post(f"/sessions/{self.id}/reward", {"reward": reward})

    def codex_config(self, model: str = "gpt-5") -> str:
        """A Codex ``config.toml`` that sends Codex to this session's base URL (Codex reads no
        base-URL variable); its key comes from ``AGENTTAP_KEY``, which must hold the session's
        ``api_key``."""
        return (
            f'model = "{model}"\nmodel_provider = "agenttap"\n\n'
            f"[model_providers.agenttap]\n"
            f'name = "agenttap"\nbase_url = "{self.base_urls["openai"]}"\n'
            f'wire_api = "responses"\nenv_key = "AGENTTAP_KEY"\n'
        )

    def rows(self) -> pa.Table:
        """The session's rows so far, late rewards joined."""
        table = self.client.request("GET", f"/sessions/{self.id}", arrow=True)[1]
        assert table is not None
        return table


class AgentTap:
    """A running agenttap instance: a mitmdump child process on free ports."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        log: Path,
        out: Path,
        proxy_url: str,
        api_url: str,
        token: str,
        ca_path: str,
    ) -> None:
        self.proc = proc
        self.log = log
        self.out = out
        self.proxy_url = proxy_url
        self.api_url = api_url
        self.token = token
        self.ca_path = ca_path
        self.client = ControlClient(api_url, token)

    @property
    def ui_url(self) -> str:
        """The live viewer of this instance's sessions and rollouts, its token in the fragment
        (the page keeps it for the tab; docs/VIEWER.md)."""
        return f"{self.api_url}/ui/#token={self.token}"

    @classmethod
    def start(
        cls,
        policy_url: str,
        tokenizer: str | os.PathLike[str],
        out: str | os.PathLike[str] = "agenttap-out",
        *,
        host: str = "127.0.0.1",
        proxy_port: int = 0,
        api_port: int = 0,
        advertise_host: str = "",
        token: str = "",
        confdir: str | os.PathLike[str] | None = None,
        options: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> AgentTap:
        """Start an instance; returns once it answers. ``host``: where the proxy and the API
        listen (loopback, or an address sandboxes elsewhere reach; ``advertise_host``: the
        name they use for it); ports 0: free ones. ``options``: more ``--set`` options.

        The token never reaches an agent: it is handed to mitmdump in a file only this user may
        read (``agenttap_token_file``), never on its command line, and mitmdump's log (which
        prints it) is kept beside it, in a private folder outside ``out`` (``log``) that the
        rollouts' sandboxes hide."""
        # This interpreter's mitmdump (the proxy's .venv), else the checkout's .venv's: a
        # trainer's environment (.venv-train, scripts/setup_train.sh) has no mitmproxy.
        mitmdump = Path(sys.executable).parent / "mitmdump"
        if not mitmdump.exists():
            mitmdump = REPO / ".venv" / "bin" / "mitmdump"
        if not mitmdump.exists():
            raise AgentTapError(
                f"no mitmdump next to {sys.executable} nor at {mitmdump}: run scripts/setup.sh "
                "(it builds .venv, the proxy's environment, whose mitmdump AgentTap.start runs)"
            )
        out_dir = Path(out).resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix="agenttap-"))  # mode 0700
        token_file = private / "token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token or secrets.token_urlsafe(24))
        log = private / "mitmdump.log"
        settings = {
            "agenttap_policy_url": policy_url,
            "agenttap_tokenizer": str(Path(tokenizer).resolve()),
            "agenttap_out": str(out_dir),
            "agenttap_api_host": host,
            "agenttap_api_port": str(api_port),
            **({"agenttap_advertise_host": advertise_host} if advertise_host else {}),
            "agenttap_token_file": str(token_file),
            "agenttap_sandbox_hide": str(private),
            **({"confdir": str(Path(confdir).resolve())} if confdir else {}),
            **(options or {}),
        }
        cmd = [
            str(mitmdump),
            "-s", str(ADDON),
            "--listen-host", host,
            "--listen-port", str(proxy_port),
        ]  # fmt: skip
        for name, value in settings.items():
            cmd += ["--set", f"{name}={value}"]
        with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:
            proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO
            )
        try:
            found = _wait_banner(proc, log, timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            # The token and the log go with it: the error carries the log's end.
            shutil.rmtree(private, ignore_errors=True)
            raise
        return cls(proc, log, out_dir, found["PROXY"], found["API"], found["TOKEN"], found["CA"])

    # -- sessions ----------------------------------------------------------------------------
    def open_session(
        self,
        id: str | None = None,
        metadata: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
    ) -> Session:
        body: dict[str, Any] = {"metadata": metadata or {}}
        if id is not None:
            body["id"] = id
        if limits:
            body["limits"] = limits
        answer = self.client.post("/sessions", body)
        return Session(
            self.client, answer["id"], answer["env"], answer["base_urls"], answer["api_key"]
        )

    def sessions(self) -> list[dict[str, Any]]:
        return list(self.client.get("/sessions")["sessions"])

    def flush(self, session: str | None = None) -> list[str]:
        query = "?" + urllib.parse.urlencode({"session": session}) if session else ""
        return list(self.client.post(f"/flush{query}")["written"])

    # -- rollouts: agenttap runs the agent too (capture/rollouts/runner.py) -------------------
    def rollout(
        self,
        agent: str | dict[str, list[str]],
        prompt: str,
        n: int = 1,
        *,
        workdir: str | os.PathLike[str] | None = None,
        limits: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        verifier: list[str] | dict[str, Any] | None = None,
        timeout_s: float | None = None,
        id: str | None = None,
        wait: bool = True,
        seed: int | None = None,
        rows: bool = True,
        image: str | None = None,
        cwd: str | None = None,
        task: str | os.PathLike[str] | None = None,
    ) -> dict[str, Any]:
        """Run ``n`` agents (``claude-code``, ``codex``, ``gemini``, ``opencode``,
        ``mini-swe-agent``, ``openhands``, ``terminus-2`` or ``{"command": [...]}``) on
        ``prompt``, each in a fresh copy of
        ``workdir``, scored by ``verifier`` (a command,
        its last stdout line the reward; or the route's whole ``{"command", "restore",
        "on_error"}``); returns, once all have ended (``wait``), each one's status,
        finish_reason, reward, metrics and rows. ``seed``: the policy's sampling is seeded
        (each agent's calls their own way), so the same prompts sample the same tokens.
        ``rows=False``: the answer leaves out the rows (read them from OUT). ``image``: each
        agent and its verifier run in a container of that image (podman), starting in its
        WORKDIR or ``cwd``, instead of a copy of ``workdir``. ``task``: a Harbor task folder
        (its image built, its instruction the prompt when ``prompt`` is empty, its tests the
        verifier, its limits)."""
        body: dict[str, Any] = {"agent": agent, "prompt": prompt, "n": n, "wait": wait}
        if task is not None:
            body["task"] = str(Path(task).resolve())
            if not prompt:
                del body["prompt"]
        if not rows:
            body["rows"] = False
        optional = {
            # The proxy's working directory is not the caller's: relative to the caller.
            "workdir": str(Path(workdir).resolve()) if workdir is not None else None,
            "limits": limits,
            "metadata": metadata,
            "verifier": (
                {"command": verifier} if isinstance(verifier, list) and verifier else verifier
            ),
            "timeout_s": timeout_s,
            "id": id,
            "seed": seed,
            "image": image,
            "cwd": cwd,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        return self.client.request("POST", "/rollouts", body, timeout=None if wait else -1.0)[0]

    def get_rollout(self, rollout_id: str) -> dict[str, Any]:
        return self.client.get(f"/rollouts/{rollout_id}")

    def reward(self, session_id: str, reward: float | dict[str, float]) -> None:
        """A reward for a session (open or closed: a late one), as ``ProxyPool.reward``."""
        self.client.post(f"/sessions/{session_id}/reward", {"reward": reward})

    def advantage(
        self,
        session_id: str,
        advantage: float,
        step: int | None = None,
        step_s: float | None = None,
    ) -> None:
        """The trainer's own advantage for a session, for the viewer (nothing trains on it),
        and the trainer's own time for its step (``step_s``) where it measured it."""
        body: dict[str, Any] = {"advantage": advantage, "step": step}
        if step_s is not None:
            body["step_s"] = step_s
        self.client.post(f"/sessions/{session_id}/advantage", body)

    def cancel_rollout(self, rollout_id: str) -> dict[str, Any]:
        """Stop a rollout: its agents' processes end, their rows are kept (``cancelled``)."""
        return self.client.request("DELETE", f"/rollouts/{rollout_id}")[0]

    # -- weights: a trainer's new weights, served by every policy replica ---------------------
    def update_weights(
        self,
        path: str | os.PathLike[str],
        version: str,
        probe: dict[str, Any] | None = None,
        model: Any = None,
        tokenizer: Any = None,
        lora: bool = False,
    ) -> dict[str, Any]:
        """Make every policy replica serve the weights ``path`` holds (a folder
        ``save_pretrained`` wrote, readable by the policy servers) under the label ``version``;
        returns ``{"version", "replicas": [...], "checked"}`` once all serve them. Calls in
        flight are paused and go on under the new weights: their rows say which tokens each
        version sampled (``weight_versions``).

        ``model`` (the trainer's model in memory, with its ``tokenizer``): a probe is computed
        from it (capture.train.probe, torch) and each replica's logprobs for it must be within
        agenttap_weights_tolerance, or ``probe`` given as ``{"ids", "logprobs"}``. A replica
        past it stays out of rotation and this raises AgentTapError (502) naming it and the
        difference.

        A PEFT ``model`` (or ``lora=True``): ``path`` is its adapter alone (what
        ``save_pretrained`` writes for a PeftModel), loaded beside the base weights with
        vLLM's runtime LoRA loading; calls from then on are sampled with it."""
        lora = lora or is_peft(model)
        where = "lora" if lora else "path"
        body: dict[str, Any] = {where: str(Path(path).resolve()), "version": str(version)}
        probe = trainer_probe(probe, model, tokenizer)
        if probe is not None:
            body["probe"] = probe
        return self.client.request("POST", "/policy/weights", body, timeout=None)[0]

    def set_weight_version(
        self,
        version: str,
        probe: dict[str, Any] | None = None,
        model: Any = None,
        tokenizer: Any = None,
    ) -> dict[str, Any]:
        """Tell agenttap the trainer pushed weights labelled ``version`` to the policy servers
        itself (verl's own weight sync): calls from now on are recorded as sampled by them.
        With ``model`` (or a ``probe``), each server's logprobs are checked against the
        trainer's, as in ``update_weights``."""
        body: dict[str, Any] = {"version": str(version)}
        probe = trainer_probe(probe, model, tokenizer)
        if probe is not None:
            body["probe"] = probe
        return self.client.request("POST", "/policy/version", body, timeout=None)[0]

    def ready(self) -> bool:
        try:
            return bool(self.client.get("/ready").get("ready"))
        except AgentTapError:
            return False

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> None:
        """Stop the instance: every session's shards are written, nothing is left running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # mitmdump read it at start; a stopped instance leaves no token file behind (its log,
        # beside it in the private folder, stays for the user to read).
        (self.log.parent / "token").unlink(missing_ok=True)

    def __enter__(self) -> AgentTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncAgentTap:
    """``AgentTap`` for asyncio code: the same calls, awaited (run in worker threads)."""

    def __init__(self, tap: AgentTap) -> None:
        self.tap = tap

    @classmethod
    async def start(cls, *args: Any, **kwargs: Any) -> AsyncAgentTap:
        return cls(await asyncio.to_thread(AgentTap.start, *args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tap, name)

    async def open_session(self, *args: Any, **kwargs: Any) -> Session:
        return await asyncio.to_thread(self.tap.open_session, *args, **kwargs)

    async def close_session(
        self, session: Session, reward: float | dict[str, float] | None = None
    ) -> pa.Table:
        return await asyncio.to_thread(session.close, reward)

    async def rollout(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.tap.rollout, *args, **kwargs)

    async def close(self) -> None:
        await asyncio.to_thread(self.tap.close)

    async def __aenter__(self) -> AsyncAgentTap:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def trainer_probe(
    probe: dict[str, Any] | None, model: Any, tokenizer: Any
) -> dict[str, Any] | None:
    """The probe a weight push is checked with: ``probe`` as given, else one computed from the
    trainer's ``model`` in memory (capture.train.probe, torch), else None (not checked)."""
    if probe is None and model is not None:
        from capture.train.probe import weights_probe

        probe = weights_probe(model, tokenizer)
    return probe


def is_peft(model: Any) -> bool:
    """Whether ``model`` is a PEFT model: its folder is an adapter, loaded as a LoRA."""
    return model is not None and hasattr(model, "peft_config")


def parse_banner(text: str) -> dict[str, str]:
    """The banner's values (PROXY, API, TOKEN, CA) found in a log's text."""
    return {m.group(1): m.group(2) for m in BANNER.finditer(text)}


def _wait_banner(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        found = parse_banner(text)
        if len(found) == 4:
            return found
        if proc.poll() is not None:
            raise AgentTapError(
                f"agenttap exited during startup (exit status {proc.returncode}); the end of its "
                f"log:\n{text[-4000:]}"
            )
        time.sleep(0.1)
    raise AgentTapError(
        f"agenttap did not start within {timeout:.0f} s (AgentTap.start's timeout=); the end "
        f"of its log:\n{log.read_text(errors='replace')[-4000:]}"
    )
