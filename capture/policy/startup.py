"""Checks at start: every policy server answers, serves a model, and tokenizes as the tokenizer
agenttap was given does. A mistake here (a wrong port, a server still loading, the tokenizer of
another model) would otherwise show up only at the first call, or worse, as silently wrong
token ids; so the proxy refuses to start and says what to fix (``agenttap_check_policy=false``
starts it anyway).

Then a policy server on TCP whose vLLM dev-mode routes (``/pause``, ``/collective_rpc``, ...)
answer without credentials gets a warning: anything on the host that reaches it can pause it or
swap its weights (a server on a unix socket, ``unix:/PATH``, is reached only through its
folder; see rewriter/policy_url.py).

Plain HTTP with the standard library, run once while mitmproxy configures the addon.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rewriter.policy_url import is_unix, urlopen
from rewriter.template import ChatTemplate

if TYPE_CHECKING:
    from capture.options import Settings

logger = logging.getLogger(__name__)

# Text whose ids tell tokenizers apart: special tokens, accents, CJK, JSON, whitespace runs.
PROBE = '<|im_start|>user\nnaïve 日本 {"k": [1, 2]}\n\n  tabs\tand <think>x</think><|im_end|>'
SKIP_HINT = "or --set agenttap_check_policy=false to start anyway"


@dataclass(frozen=True)
class Flags:
    """How the user named what the check reads: mitmdump's options, or scripts/run_proxy.sh's
    flags (``python -m capture.startup``), so an error names what the user typed."""

    policy_url: str = "--set agenttap_policy_url"
    tokenizer: str = "--set agenttap_tokenizer"
    skip: str = SKIP_HINT


RUN_PROXY_FLAGS = Flags(
    "--policy-url",
    "--tokenizer",
    "or pass -- --set agenttap_check_policy=false to start anyway",
)


def _suffix_hint(url: str) -> str:
    """A hint where the URL names an API path: agenttap wants the server's root."""
    if is_unix(url):
        # unix:/PATH/vllm.sock/v1: the socket is a file, so the path past it is "Not a directory".
        socket_path = url[len("unix:") :].rstrip("/")
        for api in ("/v1/chat/completions", "/v1/models", "/v1"):
            if socket_path.endswith(api):
                root = "unix:" + socket_path[: -len(api)]
                return f" Give the socket without {api}, e.g. {root}: agenttap adds /v1 itself."
        return ""
    path = urllib.parse.urlsplit(url).path.rstrip("/")
    if path.endswith(("/v1", "/v1/models", "/v1/chat/completions")) or path == "/v1":
        root = url[: url.index(path)] if path else url
        return f" Give the server's root without {path}, e.g. {root}: agenttap adds /v1 itself."
    return ""


def _get(url: str, path: str, timeout: float, body: Any = None) -> Any:
    """``path`` on the policy server at ``url`` (TCP or unix socket), its JSON answer."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    with urlopen(url, path, data=data, headers=headers, timeout=timeout) as resp:
        return json.loads(resp.read())


def _status(url: str, path: str, timeout: float) -> int | None:
    """The status ``GET path`` gets from the server at ``url`` (None: no answer)."""
    try:
        with urlopen(url, path, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


def open_dev_routes(url: str, timeout: float = 5.0) -> list[str]:
    """vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``) the server at ``url`` answers
    without credentials, found by requests that change nothing: ``GET /pause`` answered 405
    (the route is there, for POST, and nothing asked who calls), ``GET /is_paused`` answered
    200. [] where neither: not in dev mode, or behind something that wants credentials (401,
    403)."""
    found = []
    if _status(url, "/pause", timeout) == 405:
        found.append("POST /pause (GET /pause: 405)")
    if _status(url, "/is_paused", timeout) == 200:
        found.append("GET /is_paused (200)")
    return found


def exposure_warning(url: str, routes: list[str]) -> str:
    """What a user is told about a policy server whose dev-mode routes answer anyone."""
    return (
        f"agenttap: the policy server at {url} answers vLLM's dev-mode routes without "
        f"credentials ({'; '.join(routes)}): any process on this host that reaches it, an "
        "agent run without a sandbox or a sandbox that shares the network included, can pause "
        "it (POST /pause), put it to sleep, swap its weights (POST /collective_rpc "
        "reload_weights) or sample outside every session. vLLM's --api-key does not guard "
        "these routes. Serve it on a unix socket in a folder only you can open (vllm serve "
        "--uds /PRIVATE/vllm.sock; --set agenttap_policy_url=unix:/PRIVATE/vllm.sock), as "
        "python -m policy_server and scripts/run_proxy.sh do, or behind a proxy "
        "that wants a key for every route."
    )


def warn_if_exposed(url: str) -> str | None:
    """The warning logged for a TCP policy server whose dev-mode routes answer anyone (None:
    none is, or ``url`` is a unix socket: only its folder's owner reaches that)."""
    if is_unix(url):
        return None
    routes = open_dev_routes(url)
    if not routes:
        return None
    warning = exposure_warning(url, routes)
    logger.warning("%s", warning)
    return warning


def vocab_probe_ids(size: int, count: int = 64) -> list[int]:
    """``count`` ids spread evenly over a vocabulary of ``size``, its last id among them (a
    served vocabulary that ends sooner, or is ordered otherwise, decodes them differently)."""
    if size <= 0:
        return []
    if size <= count:
        return list(range(size))
    return sorted({round(i * (size - 1) / (count - 1)) for i in range(count)})


def _differs(ours: list[int], served: list[int]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(served, ours, strict=False)) if a != b),
        min(len(served), len(ours)),
    )
    return (
        f"gives {len(ours)} ids here and {len(served)} there, first different at position "
        f"{at} ({ours[at : at + 3]} here, {served[at : at + 3]} there)"
    )


def check_policy(
    url: str, template: ChatTemplate, timeout: float = 10.0, flags: Flags = Flags()
) -> str | None:
    """Why the policy server at ``url`` cannot be used with ``template``'s tokenizer, or None
    when it can: it must answer, serve a model, tokenize a probe text holding every special
    token of ours into the same ids (POST /tokenize), and decode ids spread over our whole
    vocabulary, its last id included, into the same text (POST /detokenize)."""
    base = url if is_unix(url) else url.rstrip("/")
    try:
        models = _get(base, "/v1/models", timeout)
        model = models["data"][0]["id"]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return (
            f"agenttap: the policy server at {url} does not answer ({reason}). Start it first "
            f"(it must serve vLLM's OpenAI API), fix {flags.policy_url}, {flags.skip}."
            f"{_suffix_hint(url)}"
        )
    except (KeyError, IndexError, TypeError):
        return (
            f"agenttap: the policy server at {url} answers GET /v1/models with no model: is "
            f"it a vLLM server? Fix {flags.policy_url}, {flags.skip}.{_suffix_hint(url)}"
        )
    mismatch = (
        f"agenttap: the tokenizer given ({flags.tokenizer}) does not match the model "
        f"{model!r} served at {url}:"
    )
    fix = f"Give the folder of the served model's tokenizer, {SKIP_HINT}."
    probe = PROBE + "".join(template.special_tokens())
    body = {"model": model, "prompt": probe, "add_special_tokens": False}
    try:
        served = _get(base, "/tokenize", timeout, body)["tokens"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None  # a server without /tokenize: nothing to compare against
        return f"agenttap: the policy server at {url} refused POST /tokenize ({exc.code})."
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
        return f"agenttap: the policy server at {url} did not tokenize a probe text ({exc})."
    ours = template.encode(probe)
    if served != ours:
        return f"{mismatch} a probe text with its special tokens {_differs(ours, served)}. {fix}"
    ids = vocab_probe_ids(template.vocab_size())
    try:
        text = _get(base, "/detokenize", timeout, {"model": model, "tokens": ids})["prompt"]
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None  # a server without /detokenize
        return (
            f"{mismatch} it refused to decode ids up to {ids[-1]}, the last of our vocabulary "
            f"of {template.vocab_size()} ({exc.code}). {fix}"
        )
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
        return f"agenttap: the policy server at {url} did not decode probe ids ({exc})."
    if text != template.decode(ids):
        return (
            f"{mismatch} {len(ids)} ids spread over our vocabulary of {template.vocab_size()} "
            f"decode to other text there. {fix}"
        )
    return None


def check_startup(settings: Settings) -> tuple[ChatTemplate | None, str | None]:
    """The policy's tokenizer, loaded once (the gateway reuses it), and why the configuration
    cannot serve (None: it can): a tokenizer folder that does not load, or a policy server that
    does not answer or tokenizes otherwise (unless ``check_policy`` is off)."""
    if settings.tokenizer is None or not settings.policy_urls:
        return None, None
    try:
        template = ChatTemplate(settings.tokenizer)
    except Exception as exc:  # a folder that holds no usable tokenizer
        return None, (
            f"agenttap: --set agenttap_tokenizer={settings.tokenizer} holds no tokenizer with a "
            f"chat template that loads ({exc}). Give the policy model's folder."
        )
    if not settings.check_policy:
        return template, None
    servers = (u for _, urls in settings.model_map for u in urls)
    urls = list(dict.fromkeys([*settings.policy_urls, *servers]))
    for url in urls:
        problem = check_policy(url, template)
        if problem:
            return template, problem
    logger.info("agenttap: policy server(s) %s answer and match the tokenizer", ", ".join(urls))
    for url in urls:
        warn_if_exposed(url)
    return template, None


def main(argv: list[str] | None = None) -> int:
    """``python -m capture.startup --policy-url URL[,URL] --tokenizer DIR``: the start-up check
    alone, before anything listens (scripts/run_proxy.sh runs it before mitmdump). Exits 1 with
    what to fix, 0 when every server answers and tokenizes as the tokenizer does."""
    import argparse
    import sys

    from capture.options.values import parse_urls

    parser = argparse.ArgumentParser(prog="python -m capture.startup", description=main.__doc__)
    parser.add_argument("--policy-url", required=True)
    parser.add_argument("--tokenizer", required=True)
    args = parser.parse_args(argv)
    try:
        urls = parse_urls(args.policy_url)
        template = ChatTemplate(args.tokenizer)
    except Exception as exc:  # a bad URL, a folder without a tokenizer
        print(f"agenttap: {exc}", file=sys.stderr)
        return 1
    for url in urls:
        problem = check_policy(url, template, flags=RUN_PROXY_FLAGS)
        if problem:
            print(problem, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
