"""The weights the policy serves are the trainer's, exactly and provably (issue 38), with the real
vLLM (fp32 tiny Qwen3), through a real mitmdump:

- a training step on a model with tied embeddings (``tie_word_embeddings``: no ``lm_head`` in
  the checkpoint), pushed with ``POST /policy/weights`` and a probe: every trained token of the
  next calls, on both replicas, is the new weights' HF forward (not a mix of old and new, which
  is what vLLM's plain ``reload_weights`` serves on a CPU); and the same on an untied model;
- a replica that reads a wrong folder at the pushed path (one tensor changed) fails the probe:
  502 naming it and the difference, it leaves rotation, calls go to the other;
- a reload done behind agenttap's back is found within ``agenttap_weights_check_s``;
- a paused replica is unhealthy, named so by /ready and /replicas, and no call waits on it.

Two tied replicas share this module (started at once); the second runs in a mount namespace
where the folder ``pushes/`` is another one, as a node whose copy of a checkpoint differs.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policy_server import launcher
from rewriter.policy_url import urlopen
from tests.e2e.policy.test_policy_weights_vllm import control, hf
from tests.support.paths import QWEN3, REPO
from tests.support.proxies import Proxy, proxy_token, start_proxy
from tests.support.vllm_servers import LORA, ONE_FLOATING_THREAD, VllmServers
from tests.support.warm_python import warm

pytestmark = pytest.mark.vllm

HF_PYTHON = launcher.VLLM_PYTHON
PEFT_PYTHON = REPO / ".venv-train" / "bin" / "python"  # peft lives there
CHECK_S = 2  # agenttap_weights_check_s of this module's proxy
TOLERANCE = 1e-3


def trainer(*args: str, python: Path = HF_PYTHON, stdin: Any = None) -> Any:
    """tests/support/weights_step.py in the trainer's environment (a warm interpreter: torch
    imported once); its JSON output (a probe) or None."""
    done = warm(python).run(
        REPO / "tests" / "support" / "weights_step.py", *args,
        stdin=json.dumps(stdin) if stdin is not None else None,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout) if done.stdout.strip() else None


def policy_post(url: str, path: str, body: Any = None) -> int:
    """A request straight to a policy server (behind agenttap's back), its status. Routes
    that take no body get none: vLLM answers those before reading one, and closes."""
    data = json.dumps(body).encode() if body is not None else b""
    with urlopen(url, path, data=data, headers={"Content-Type": "application/json"}) as resp:
        return int(resp.status)


def served_logprobs(url: str, ids: list[int]) -> list[float]:
    data = json.dumps(
        {"model": "agenttap-tiny-qwen3", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    ).encode()
    with urlopen(
        url, "/v1/completions", data=data, headers={"Content-Type": "application/json"}
    ) as r:
        entries = json.load(r)["choices"][0]["prompt_logprobs"]
    return [0.0] + [entries[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]


def max_gap(a: list[float], b: list[float], positions: list[int]) -> float:
    x, y = np.asarray(a, np.float64)[positions], np.asarray(b, np.float64)[positions]
    return float(np.max(np.abs(x - y))) if positions else 0.0


class Tied:
    """The module's two tied replicas: ``urls[0]`` sees the host's files, ``urls[1]`` sees
    ``wrong`` where the host has ``pushes``."""

    def __init__(self, root: Path, model: Path, urls: list[str]) -> None:
        self.root, self.model, self.urls = root, model, urls
        self.pushes, self.wrong = root / "pushes", root / "wrong"


@pytest.fixture(scope="module", autouse=True)
def lora_boots_meanwhile(vllm_servers: VllmServers) -> None:
    """The LoRA server (fixture ``lora_vllm``, last in this module) boots while the tied pair's
    tests run, instead of after them."""
    vllm_servers.start(LORA)


def compiled(log: Path, proc: subprocess.Popen[bytes], timeout_s: float = 900) -> None:
    """Until the vLLM writing ``log`` has warmed its model up (compiled, where it compiles),
    or has ended."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        if log.exists() and "init engine (profile, create kv cache, warmup model)" in log.read_text(
            errors="replace"
        ):
            return
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tied() -> Iterator[Tied]:
    root = Path(tempfile.mkdtemp(prefix="at-w-"))  # short: unix socket paths are bounded
    model = root / "tied-model"
    built = warm(HF_PYTHON).run(
        REPO / "scripts" / "build_tiny_model.py", "--tokenizer", str(QWEN3), "--out", str(model),
        "--tied",
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    for name in ("pushes", "wrong", "a", "b"):
        (root / name).mkdir(mode=0o700)
    netns = launcher.own_network()
    assert netns, "bwrap cannot make a namespace here; these tests need it"
    view = [*netns[:-2], "--bind", str(root / "wrong"), str(root / "pushes"), *netns[-2:]]
    procs, urls = [], []
    try:
        for name, prefix in (("a", netns), ("b", view)):
            if procs:
                # The second starts once the first has compiled this shape into the run's
                # compile cache, and reuses it: not two compiles of one graph at once.
                compiled(root / "vllm-a.log", procs[0])
            sock = root / name / "vllm.sock"
            procs.append(
                launcher.start_vllm(
                    model, socket_path=sock, netns=prefix, max_model_len=4096,
                    log_path=root / f"vllm-{name}.log", env_overrides=ONE_FLOATING_THREAD,
                )
            )  # fmt: skip
            urls.append(f"unix:{sock}")
        for url, proc, name in zip(urls, procs, "ab", strict=True):
            try:
                launcher.wait_ready(url, proc, timeout_s=900)
            except launcher.PolicyServerError:
                print((root / f"vllm-{name}.log").read_text()[-5000:])
                raise
        yield Tied(root, model, urls)
    finally:
        for proc in procs:
            launcher.stop(proc)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tied_proxy(tied: Tied, confdir: Path) -> Iterator[Proxy]:
    out = tied.root / "out"
    proxy = start_proxy(
        ",".join(tied.urls), out, confdir,
        extra=["--set", f"agenttap_weights_check_s={CHECK_S}"],
    )  # fmt: skip
    yield proxy
    proxy.stop()


def chat(proxy: Proxy, session: str, monkeypatch: pytest.MonkeyPatch, tokens: int = 24) -> dict:
    """One call of ``tokens`` sampled tokens in a new session; its thread row."""
    client = proxy.openai(session, monkeypatch)
    client.chat.completions.create(
        model="gpt-4o",
        messages=[{"role": "user", "content": f"Say something, {session}."}],
        max_tokens=tokens,
        extra_body={"ignore_eos": True},
    )
    (row,) = proxy.threads(session, expect=1)
    return row


def rows_against(rows: list[dict], new: Path, old: Path) -> tuple[float, float, int]:
    """Max |row logprob - HF forward| over every trained token, under the new and the old
    weights; the number of trained tokens."""
    ids = [r["input_ids"] for r in rows]
    new_scores = hf("score", str(new), stdin={"rows": ids})
    old_scores = hf("score", str(old), stdin={"rows": ids})
    worst_new = worst_old = 0.0
    tokens = 0
    for row, ns, os_ in zip(rows, new_scores, old_scores, strict=True):
        trained = [i for i, m in enumerate(row["loss_mask"]) if m]
        tokens += len(trained)
        worst_new = max(worst_new, max_gap(row["logprobs"], ns, trained))
        worst_old = max(worst_old, max_gap(row["logprobs"], os_, trained))
    return worst_new, worst_old, tokens


def push(proxy: Proxy, folder: Path, version: str, probe: Any = None) -> tuple[int, Any, float]:
    body: dict[str, Any] = {"path": str(folder), "version": version}
    if probe is not None:
        body["probe"] = probe
    started = time.monotonic()
    status, answer = control(proxy, "POST", "/policy/weights", body)
    return status, answer, time.monotonic() - started


def replicas_by_url(proxy: Proxy) -> dict[str, dict]:
    return {r["url"]: r for r in control(proxy, "GET", "/replicas")[1]["replicas"]}


def test_tied_embeddings_update_exactly_on_every_replica(
    tied: Tied, tied_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = tied.model, tied.root / "step-1"
    probe = trainer("step", str(old), str(new), "1")
    # What vLLM's own reload_weights serves for a tied checkpoint on a CPU (the cause): the
    # new body with the old output layer. Measured on replica a, then replaced by agenttap's.
    new_forward = hf("score", str(new), stdin={"rows": [probe["ids"]]})[0]
    policy_post(tied.urls[0], "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(new)}})  # fmt: skip
    policy_post(tied.urls[0], "/reset_prefix_cache")
    mixed = served_logprobs(tied.urls[0], probe["ids"])
    positions = list(range(1, len(probe["ids"])))
    print(f"vLLM's reload_weights alone, tied: {max_gap(mixed, new_forward, positions):.3g} "
          "from the new weights' forward")  # fmt: skip

    status, answer, seconds = push(tied_proxy, new, "step-1", probe)
    assert status == 200, answer
    assert answer["checked"] is True and all(o["ok"] for o in answer["replicas"])
    diffs = [o["max_diff"] for o in answer["replicas"]]
    assert max(diffs) < TOLERANCE, answer
    rows = [chat(tied_proxy, f"tied-{i}", monkeypatch) for i in range(4)]
    backends = {t["backend"] for r in rows for t in r["turns"]}
    assert backends == set(tied.urls), backends  # both replicas answered
    assert all(v["version"] == "step-1" for r in rows for v in r["weight_versions"])
    worst_new, worst_old, tokens = rows_against(rows, new, old)
    print(f"tied: update with probe {seconds:.2f} s; {tokens} trained tokens: max |diff| "
          f"{worst_new:.2e} from the new weights, {worst_old:.2f} from the old; probe "
          f"max |diff| per replica {diffs}")  # fmt: skip
    assert worst_new < TOLERANCE and worst_old > 1e-2

    # Without a probe: it works and says nothing was checked.
    status, answer, bare = push(tied_proxy, new, "step-1b")
    assert status == 200 and answer["checked"] is False and "no probe" in answer["note"]
    print(f"tied: update without a probe {bare:.2f} s")


@pytest.mark.policy_exclusive  # pushes weights into the session's vLLM
def test_untied_update_is_exact(
    vllm_url: str, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = launcher.ensure_tiny_model(tokenizer=QWEN3)
    new = tmp_path / "untied-step-1"
    probe = trainer("step", str(original), str(new), "3")
    proxy = start_proxy(vllm_url, tmp_path / "out", confdir)
    try:
        status, answer, seconds = push(proxy, new, "untied-1", probe)
        assert status == 200 and answer["checked"] is True, answer
        rows = [chat(proxy, f"untied-{i}", monkeypatch) for i in range(2)]
        worst_new, worst_old, tokens = rows_against(rows, new, original)
        print(f"untied: update {seconds:.2f} s; {tokens} trained tokens: max |diff| "
              f"{worst_new:.2e} from the new weights, {worst_old:.2f} from the old")  # fmt: skip
        assert worst_new < TOLERANCE and worst_old > 1e-2
    finally:
        # The other tests' policy: the original weights, pushed back the same way.
        status, answer, _ = push(proxy, original, "default", trainer("probe", str(original)))
        proxy.stop()
    assert status == 200, answer


def test_a_replica_reading_a_wrong_folder_fails_the_probe_and_leaves_rotation(
    tied: Tied, tied_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = tied.pushes / "step-2"
    probe = trainer("step", str(tied.model), str(good), "2")
    # Replica b reads this folder at good's path: one tensor differs.
    trainer("corrupt", str(good), str(tied.wrong / "step-2"))
    status, answer, _ = push(tied_proxy, good, "step-2", probe)
    a, b = tied.urls
    assert status == 502, answer
    message = answer["error"]["message"]
    assert b in message and "from the trainer's" in message, message
    outcomes = {o["url"]: o for o in answer["replicas"]}
    assert outcomes[a]["ok"] is True and outcomes[a]["max_diff"] < TOLERANCE
    assert outcomes[b]["ok"] is False and outcomes[b]["max_diff"] > TOLERANCE
    print(f"wrong folder: replica b is {outcomes[b]['max_diff']:.3g} from the trainer's probe")
    state = replicas_by_url(tied_proxy)
    assert state[b]["state"] == "unverified" and state[b]["in_rotation"] is False
    assert "from the trainer's" in state[b]["unverified"]
    # Every call goes to the replica that passed, and samples the trainer's weights.
    rows = [chat(tied_proxy, f"wrong-{i}", monkeypatch) for i in range(3)]
    assert {t["backend"] for r in rows for t in r["turns"]} == {a}
    worst_new, _, _ = rows_against(rows, good, tied.model)
    assert worst_new < TOLERANCE
    # The next good update verifies b again.
    status, answer, _ = push(tied_proxy, tied.model, "back", trainer("probe", str(tied.model)))
    assert status == 200, answer
    assert replicas_by_url(tied_proxy)[b]["state"] == "serving"


def test_a_reload_behind_agenttaps_back_is_found_within_the_check_period(
    tied: Tied, tied_proxy: Proxy
) -> None:
    b = tied.urls[1]
    other = tied.root / "step-x"
    trainer("step", str(tied.model), str(other), "5")
    assert replicas_by_url(tied_proxy)[b]["state"] == "serving"
    policy_post(b, "/collective_rpc",
                {"method": "agenttap_reload_weights", "kwargs": {"weights_path": str(other)}})  # fmt: skip
    swapped = time.monotonic()
    while replicas_by_url(tied_proxy)[b]["state"] != "unverified":
        assert time.monotonic() - swapped < CHECK_S + 20, replicas_by_url(tied_proxy)[b]
        time.sleep(0.2)
    unnoticed = time.monotonic() - swapped
    print(f"a reload behind agenttap's back went unnoticed for {unnoticed:.1f} s "
          f"(agenttap_weights_check_s={CHECK_S})")  # fmt: skip
    assert unnoticed < CHECK_S + 10
    assert "without a weight update" in replicas_by_url(tied_proxy)[b]["unverified"]
    log = tied_proxy.log.read_text(errors="replace")
    assert "left rotation" in log and "weights_unverified" in log
    metrics = metrics_text(tied_proxy)
    assert f'agenttap_policy_weights_changed_total{{backend="{b}"}} 1.0' in metrics, metrics
    status, answer, _ = push(tied_proxy, tied.model, "back-2", trainer("probe", str(tied.model)))
    assert status == 200, answer


def metrics_text(proxy: Proxy) -> str:
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": f"http://127.0.0.1:{proxy.port}"})
    )
    req = urllib.request.Request(
        "http://agenttap.local/metrics",
        headers={"Authorization": f"Bearer {proxy_token(proxy.log)}"},
    )
    with opener.open(req, timeout=60) as resp:
        return str(resp.read().decode())


def test_a_paused_replica_is_unhealthy_and_no_call_waits_on_it(
    tied: Tied, tied_proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tied.urls
    assert policy_post(b, "/pause?mode=keep") == 200
    try:
        paused = time.monotonic()
        while replicas_by_url(tied_proxy)[b]["state"] != "paused":
            assert time.monotonic() - paused < 40, replicas_by_url(tied_proxy)[b]
            time.sleep(0.2)
        print(f"paused replica found in {time.monotonic() - paused:.1f} s")
        status, ready = control(tied_proxy, "GET", "/ready")
        assert status == 200 and {"url": b, "state": "paused"} in ready["replicas"]
        started = time.monotonic()
        rows = [chat(tied_proxy, f"paused-{i}", monkeypatch, tokens=8) for i in range(3)]
        assert time.monotonic() - started < 60
        assert {t["backend"] for r in rows for t in r["turns"]} == {a}
    finally:
        policy_post(b, "/resume")  # agenttap resumes only what it paused itself
    resumed = time.monotonic()
    while replicas_by_url(tied_proxy)[b]["state"] != "serving":
        assert time.monotonic() - resumed < 40, replicas_by_url(tied_proxy)[b]
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lora_vllm(vllm_servers: VllmServers) -> Iterator[str]:
    """The untied tiny model served with runtime LoRA loading (--max-lora-rank 8)."""
    server = vllm_servers.ready(LORA)
    LORA_LOGS.append(server.log)
    yield server.url
    vllm_servers.stop(LORA)


# The LoRA server's log: printed when a call fails, as the 502 only says "EngineCore encountered
# an issue" and the cause is in vLLM's own output.
LORA_LOGS: list[Path] = []


def test_a_lora_adapter_is_served_exactly(
    lora_vllm: str, confdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = launcher.ensure_tiny_model(tokenizer=QWEN3)
    adapter = tmp_path / "adapter-1"
    probe = trainer("lora", str(base), str(adapter), "4", python=PEFT_PYTHON)
    assert (adapter / "adapter_config.json").exists() and not (
        adapter / "model.safetensors"
    ).exists()
    proxy = start_proxy(lora_vllm, tmp_path / "out", confdir)
    try:
        status, answer = control(
            proxy,
            "POST",
            "/policy/weights",
            {"lora": str(adapter), "version": "lora-1", "probe": probe},
        )
        assert status == 200 and answer["checked"] is True, answer
        try:
            rows = [chat(proxy, f"lora-{i}", monkeypatch) for i in range(2)]
        except Exception:
            print("".join(log.read_text()[-12000:] for log in LORA_LOGS))
            raise
    finally:
        proxy.stop()
    assert all(v["version"] == "lora-1" for r in rows for v in r["weight_versions"])
    ids = [r["input_ids"] for r in rows]
    peft = trainer("score-lora", str(base), str(adapter), python=PEFT_PYTHON, stdin={"rows": ids})
    plain = hf("score", str(base), stdin={"rows": ids})
    worst_peft = worst_base = 0.0
    for row, with_adapter, without in zip(rows, peft, plain, strict=True):
        trained = [i for i, m in enumerate(row["loss_mask"]) if m]
        worst_peft = max(worst_peft, max_gap(row["logprobs"], with_adapter, trained))
        worst_base = max(worst_base, max_gap(row["logprobs"], without, trained))
    print(f"LoRA: probe max |diff| {answer['replicas'][0]['max_diff']:.2e}; rows vs the PEFT "
          f"forward {worst_peft:.2e}, vs the base alone {worst_base:.2f}")  # fmt: skip
    assert worst_peft < TOLERANCE and worst_base > 1e-2


def lora_prompt_logprobs(url: str, model: str, ids: list[int]) -> list[float]:
    data = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})
    with urlopen(
        url, "/v1/completions", data=data.encode(), headers={"Content-Type": "application/json"},
        timeout=300,
    ) as r:  # fmt: skip
        entries = json.load(r)["choices"][0]["prompt_logprobs"]
    return [0.0] + [entries[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]


def test_prompt_logprobs_under_lora_are_exact_in_a_busy_batch(
    lora_vllm: str, tmp_path: Path
) -> None:
    """vLLM's CPU LoRA logits layer gives a prompt's rows one adapter slot per request, which
    broadcasts only when the step holds one request: with several (a probe or a health check
    beside a generation) the engine died (policy_server/lora_logits.py). Prompt logprobs of
    LoRA and base prompts sent at once, beside generations, equal each one's alone."""
    base = launcher.ensure_tiny_model(tokenizer=QWEN3)
    adapter = tmp_path / "adapter-busy"
    trainer("lora", str(base), str(adapter), "5", python=PEFT_PYTHON)
    body = json.dumps({"lora_name": "busy-lora", "lora_path": str(adapter)}).encode()
    with urlopen(
        lora_vllm, "/v1/load_lora_adapter", data=body,
        headers={"Content-Type": "application/json"},
    ) as resp:  # fmt: skip
        assert resp.status == 200
    # All under the adapter, as agenttap asks a replica serving one (vLLM's CPU LoRA layers
    # apply the adapter to a base-model request batched with adapter ones: docs/API.md).
    asks = [
        ("busy-lora", [100 + (k * 37 + j * 11) % 3000 for j in range(20 + 9 * k)]) for k in range(6)
    ]
    gen = json.dumps(
        {"model": "busy-lora", "prompt": [300, 400, 500], "max_tokens": 24, "ignore_eos": True}
    ).encode()

    def generate() -> int:
        # A loaded CPU decodes a few tokens a second: no 10 s default here.
        with urlopen(
            lora_vllm, "/v1/completions", data=gen, headers={"Content-Type": "application/json"},
            timeout=300,
        ) as r:  # fmt: skip
            return int(r.status)

    start = threading.Barrier(len(asks) + 2)

    def at_once(task: Any) -> Any:
        start.wait(60)
        return task()

    with ThreadPoolExecutor(len(asks) + 2) as pool:
        futures = [pool.submit(at_once, generate) for _ in range(2)]
        futures += [
            pool.submit(at_once, functools.partial(lora_prompt_logprobs, lora_vllm, m, ids))
            for m, ids in asks
        ]
        together = [f.result(timeout=600) for f in futures]
    assert together[:2] == [200, 200]
    alone = [lora_prompt_logprobs(lora_vllm, m, ids) for m, ids in asks]
    worst = max(
        max_gap(a, b, list(range(1, len(a)))) for a, b in zip(together[2:], alone, strict=True)
    )
    with_adapter = max_gap(alone[0], lora_prompt_logprobs(lora_vllm, "agenttap-tiny-qwen3",
                                                          asks[0][1]), list(range(1, 20)))  # fmt: skip
    print(f"LoRA prompt logprobs in a batch of {len(asks) + 2}: max |diff| to alone {worst:.2e}; "
          f"adapter vs base {with_adapter:.2f}")  # fmt: skip
    assert worst < 1e-5 and with_adapter > 1e-2
