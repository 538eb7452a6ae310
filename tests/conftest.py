"""Hooks and fixtures only: the real tokenizers, a real vLLM (once per test session), a scripted
vLLM-shaped stub, and real ``mitmdump`` processes running the addon. The helpers they use live in
``tests/support/`` (``paths.py``, ``proxies.py``, ``stub_vllm.py``, ``vllm_servers.py``)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# This environment sets PYTHONDONTWRITEBYTECODE=1: without a bytecode cache every pytest process
# (the main one and each xdist worker) compiles and assert-rewrites ~400 modules afresh at each run
# (collection 17 s -> 12 s with it). Only the test processes keep theirs: what they start
# (sandboxes, verifiers, task containers) inherits the variable unchanged.
sys.dont_write_bytecode = False
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policy_server import launcher as policy_server  # noqa: E402
from tests.support.paths import QWEN3, QWEN25  # noqa: E402
from tests.support.proxies import (  # noqa: E402
    _VLLM_OUTS,
    ROW_CHECKS,
    Proxy,
    check_recorded_rows,
    start_proxy,
)
from tests.support.stub_vllm import StubPolicy  # noqa: E402
from tests.support.vllm_servers import (  # noqa: E402
    BY_FIXTURE,
    PRESTARTED,
    SESSION,
    VllmServers,
)

# CI runs with CI=true: property and fuzz tests replay the same examples every run (a red CI
# must be reproducible, not a new random draw); locally they keep exploring new ones.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    assert (QWEN3 / "tokenizer.json").exists(), f"Qwen3 tokenizer missing at {QWEN3}"
    return QWEN3


@pytest.fixture(scope="session")
def qwen25_dir() -> Path:
    assert (QWEN25 / "tokenizer.json").exists(), f"Qwen2.5 tokenizer missing at {QWEN25}"
    return QWEN25


@pytest.fixture(scope="session")
def tok(qwen3_dir: Path):  # type: ignore[no-untyped-def]
    """The Qwen3 tokenizer itself (transformers), for tests that decode or count ids."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_dir))


# The run's real vLLM servers (tests/support/vllm_servers.py): those the collected tests need
# start in the background when collection ends, and boot while the unit tests run. Under
# pytest-xdist the workers share them through AGENTTAP_TEST_RUN_DIR, which the controller makes.
RUN_DIR = "AGENTTAP_TEST_RUN_DIR"
_SERVERS: VllmServers | None = None


def _vllm_servers() -> VllmServers:
    global _SERVERS
    if _SERVERS is None:
        _SERVERS = VllmServers(Path(os.environ[RUN_DIR]), QWEN3)
    return _SERVERS


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _is_worker(config):
        return  # the controller's folders, in the environment it started this worker with
    # Made before xdist starts its workers, which inherit them through the environment.
    if RUN_DIR not in os.environ:
        os.environ[RUN_DIR] = tempfile.mkdtemp(prefix="agenttap-test-run-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(RUN_DIR), True))
    # One compile cache for every vLLM this run starts on TCP (policy_server.start_vllm keeps
    # a value already set): a server of a shape already built reuses its kernels.
    if "VLLM_CACHE_ROOT" not in os.environ:
        os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="agenttap-test-vllm-cache-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("VLLM_CACHE_ROOT"), True))
    # The tiny policy model, built once here: workers (and run_proxy.sh) only read it.
    if policy_server.VLLM_PYTHON.exists() and not config.option.collectonly:
        policy_server.ensure_tiny_model(tokenizer=QWEN3)


# Modules that start vLLM servers of their own (about 3.5 GB each, up to four at once): under
# xdist they run one after another on one worker, never two at once, and first (the longest
# part of the run). The trainers' (torch) and the examples (which write into the checkout)
# share a group of their own.
OWN_SERVERS = "own-vllm-servers"
_GROUPS = {
    "tests/e2e/policy/test_failover_vllm.py": OWN_SERVERS,
    "tests/e2e/policy/test_weight_versions_vllm.py": OWN_SERVERS,
    "tests/e2e/policy/test_weights_exact_vllm.py": OWN_SERVERS,
    "tests/e2e/policy/test_run_proxy.py": OWN_SERVERS,
    "tests/e2e/rollouts/test_train_trl_loop.py": "trainers",
    "tests/e2e/rollouts/test_train_verl.py": "trainers",
    "tests/e2e/rollouts/test_train_example.py": "trainers",
    "tests/e2e/rollouts/test_examples.py": "trainers",
    # Each starts a local Ray cluster: two at once on one machine may find each other's.
    "tests/e2e/rollouts/test_ray_pool.py": "ray",
    "tests/e2e/rollouts/test_ray_rollouts.py": "ray",
    "tests/e2e/ops/test_snippets.py": "ray",  # its Ray snippets start local clusters
    "tests/e2e/ops/test_shards_and_recovery.py": "ray",
}


def _group(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return _GROUPS.get(module, module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker, the OWN_SERVERS group first: it is the longest part of the run."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: _group(item.nodeid) != OWN_SERVERS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """A test on the session's vLLM holds it from its fixtures' setup to their teardown: shared,
    or alone when it changes the server for everyone (marked ``policy_exclusive``). Under xdist
    that keeps one worker's pause or weight push from reaching the other worker's test."""
    if "vllm_url" not in getattr(item, "fixturenames", ()):
        return (yield)
    exclusive = item.get_closest_marker("policy_exclusive") is not None
    with _vllm_servers().using(SESSION, exclusive):
        return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's controller hands out work by group (scripts/test.sh): a module's tests stay on one
    worker (its module fixtures, a proxy or a CLI's install, are made once), and the modules of
    a group in _GROUPS share one, in collection order. (xdist's own ``--dist loadgroup`` names a
    test's group in its node id, which pytest 9.2 no longer lets a plugin change.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    wanted = {
        BY_FIXTURE[name]
        for item in session.items
        for name in getattr(item, "fixturenames", ())
        if name in BY_FIXTURE and BY_FIXTURE[name] in PRESTARTED
    }
    for config in sorted(wanted, key=lambda c: c.name):
        _vllm_servers().start(config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Whatever ended the session (a failure with -x, Ctrl-C): no vLLM outlives it. A worker
    # stops its own; the controller (or a run without workers) every server of the run.
    if _is_worker(session.config):
        if _SERVERS is not None:
            _SERVERS.stop_all()
        session.config.workeroutput["row_checks"] = ROW_CHECKS  # type: ignore[attr-defined]
        return
    _vllm_servers().stop_all(everything=True)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: a worker's row checks, printed with the run's summary."""
    ROW_CHECKS.extend(getattr(node, "workeroutput", {}).get("row_checks", []))


@pytest.fixture(scope="session")
def vllm_servers() -> VllmServers:
    return _vllm_servers()


@pytest.fixture(scope="session")
def vllm_url(vllm_servers: VllmServers) -> Iterator[str]:
    """A real vLLM serving the tiny fp32 Qwen3 model (cold start about a minute)."""
    url = vllm_servers.ready(SESSION).url
    _VLLM_OUTS[url] = []
    yield url
    try:
        check_recorded_rows(policy_server.ensure_tiny_model(tokenizer=QWEN3), _VLLM_OUTS.pop(url))
    finally:
        vllm_servers.stop(SESSION)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in ROW_CHECKS:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def stub() -> Iterator[StubPolicy]:
    policy = StubPolicy(str(QWEN3))
    policy.start()
    yield policy
    policy.stop()


@pytest.fixture(scope="session")
def confdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mitmconf")


@pytest.fixture(scope="session")
def stub_proxy(
    stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    proxy = start_proxy(stub.url, tmp_path_factory.mktemp("stub-proxy") / "out", confdir)
    yield proxy
    proxy.stop()


@pytest.fixture(scope="session")
def vllm_proxy(
    vllm_url: str, confdir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    proxy = start_proxy(vllm_url, tmp_path_factory.mktemp("vllm-proxy") / "out", confdir)
    yield proxy
    proxy.stop()


@pytest.fixture(scope="session")
def stub_tap(stub: StubPolicy, confdir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """agenttap started as a trainer starts it (capture/client/launcher.py), answered by the stub."""
    from capture.client.launcher import AgentTap

    instance = AgentTap.start(
        stub.url, QWEN3, tmp_path_factory.mktemp("tap") / "out", confdir=confdir
    )
    yield instance
    instance.close()
