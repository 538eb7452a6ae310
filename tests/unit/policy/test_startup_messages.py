"""The start-up check's errors name what the user typed: run_proxy.sh's flags when it runs the
check (``python -m capture.startup``), mitmdump's options otherwise, and the fix for a URL that
names an API path (``/v1``) instead of the server's root."""

from __future__ import annotations

import socket

import pytest

from capture.policy.startup import RUN_PROXY_FLAGS, check_policy, main
from rewriter.template import ChatTemplate
from tests.support.paths import QWEN3


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(str(QWEN3))


def test_run_proxy_errors_name_its_flags_and_the_v1_fix(template: ChatTemplate) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    said = check_policy(url, template, timeout=2, flags=RUN_PROXY_FLAGS)
    assert said is not None
    assert "fix --policy-url" in said and "agenttap_policy_url" not in said
    assert "without /v1" in said and f"{url[:-3]}: agenttap adds /v1 itself" in said


def test_mitmdump_errors_name_its_option_and_no_hint_for_a_root(template: ChatTemplate) -> None:
    said = check_policy(f"http://127.0.0.1:{closed_port()}", template, timeout=2)
    assert said is not None and "fix --set agenttap_policy_url" in said
    assert "without" not in said


def test_the_entry_point_run_proxy_calls_speaks_its_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        ["--policy-url", f"http://127.0.0.1:{closed_port()}/v1/", "--tokenizer", str(QWEN3)]
    )
    err = capsys.readouterr().err
    assert code == 1 and "--policy-url" in err and "without /v1" in err


def test_a_unix_url_past_its_socket_is_told_the_sockets_own(template: ChatTemplate) -> None:
    """``unix:/PATH/vllm.sock/v1`` said only "Not a directory" (issue 51)."""
    said = check_policy("unix:/tmp/agenttap-x/vllm.sock/v1", template, timeout=2)
    assert said is not None
    assert "Give the socket without /v1, e.g. unix:/tmp/agenttap-x/vllm.sock" in said, said
