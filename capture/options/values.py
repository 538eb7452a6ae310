"""agenttap's option values: the pure parsers that read one option's text
(``capture/options/declared.py`` declares which option each one reads).

Each takes the text a user gave and returns the typed value, or raises ``ValueError`` worded for
the user (``capture.options.reading.describe`` puts the option's name and help before it);
nothing here knows mitmproxy. Values users naturally write are read: YAML numbers and booleans in
``config.yaml``, and ``true/false/yes/no/on/off/1/0`` for switches.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from pathlib import Path

from rewriter.policy_url import parse_policy_url

TRUE = frozenset({"true", "yes", "on", "1"})
FALSE = frozenset({"false", "no", "off", "0"})


def parse_text(text: str) -> str:
    return text.strip()


def parse_whole(text: str, positive: bool = False) -> int:
    """A whole number, zero or more (more than zero when ``positive``)."""
    cleaned = text.strip().replace("_", "")
    try:
        value = int(cleaned, 10)
    except ValueError:
        # YAML may hand a whole number over as 30.0
        try:
            as_float = float(cleaned)
        except ValueError:
            raise ValueError("is not a whole number") from None
        if not math.isfinite(as_float) or not as_float.is_integer():
            raise ValueError("is not a whole number") from None
        value = int(as_float)
    _check_sign(value, positive)
    return value


def parse_seconds(text: str, positive: bool = False) -> float:
    """A number of seconds (fractions allowed), zero or more (more than zero when ``positive``)."""
    try:
        value = float(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError("is not a number") from None
    if not math.isfinite(value):
        raise ValueError("is not a finite number")
    _check_sign(value, positive)
    return int(value) if value.is_integer() else value


def _check_sign(value: float, positive: bool) -> None:
    if value < 0:
        raise ValueError("must be zero or more")
    if positive and value == 0:
        raise ValueError("is not allowed: it must be more than zero")


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ValueError("is not a switch: write true/false (yes/no, on/off and 1/0 work too)")


def parse_choice(text: str, choices: tuple[str, ...]) -> str:
    word = text.strip().lower()
    if word not in choices:
        raise ValueError(f"is not one of {', '.join(choices)}")
    return word


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_urls(text: str) -> list[str]:
    """Comma-separated policy server URLs: http(s)://HOST:PORT, or unix:/PATH for a server on a
    unix socket (vLLM's --uds PATH; rewriter/policy_url.py); empty: none given (the policy is
    not configured)."""
    return [parse_policy_url(url).url for url in parse_list(text)]


def parse_hosts(text: str) -> frozenset[str]:
    hosts = frozenset(h.lower() for h in parse_list(text))
    if not hosts:
        raise ValueError("lists no host; give at least one API host")
    for host in hosts:
        if not all(c.isalnum() or c in "-._" for c in host) or host.startswith("."):
            raise ValueError(f"{host!r} is not a host name")
    return hosts


def parse_passthrough(text: str) -> tuple[str, ...]:
    """Host patterns (fnmatch: ``*.pypi.org``) whose traffic is tunnelled or forwarded unchanged."""
    patterns = tuple(p.lower() for p in parse_list(text))
    for pattern in patterns:
        if not all(c.isalnum() or c in "-._*?" for c in pattern) or pattern.strip("*.?") == "":
            raise ValueError(f"{pattern!r} is not a host name or pattern such as *.pypi.org")
    return patterns


def passes_through(host: str, patterns: Iterable[str]) -> bool:
    host = host.lower().rstrip(".")
    return any(fnmatch.fnmatchcase(host, pattern) for pattern in patterns)


def parse_host(text: str) -> str:
    """A host name or IP address to listen on or hand out; empty: not given."""
    host = text.strip()
    if host and not all(c.isalnum() or c in "-._:" for c in host):
        raise ValueError(f"{host!r} is not a host name or IP address")
    return host


def parse_port(text: str) -> int:
    port = parse_whole(text)
    if port > 65535:
        raise ValueError("is not a port (0 to 65535)")
    return port


# A token shorter than this, or one character repeated, is refused: the token is the trainer's
# key to every session, reward and rollout, and agents under training guess.
MIN_TOKEN_CHARS = 24
TOKEN_CHARS = "letters, digits and - . _ ~"


def parse_token(text: str) -> str:
    """The control API's bearer token; empty: a random one is made at each start."""
    token = text.strip()
    if not token:
        return token
    if not all(c.isalnum() or c in "-._~" for c in token):
        raise ValueError(f"must be made of {TOKEN_CHARS} only")
    if len(token) < MIN_TOKEN_CHARS or len(set(token)) == 1:
        raise ValueError(
            f"is too weak: a token must be at least {MIN_TOKEN_CHARS} characters and not one "
            f"character repeated. Make one with: python3 -c 'import secrets; "
            f"print(secrets.token_urlsafe(24))'"
        )
    return token


def parse_token_file(text: str) -> str:
    """The token read from a file only its owner may read (mode 0600, or 0400); empty: none.
    A file others can read is refused: the token must never reach an agent."""
    if not text.strip():
        return ""
    path = Path(text.strip()).expanduser()
    try:
        mode = path.stat().st_mode
        content = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot be read ({exc.strerror or exc})") from None
    if mode & 0o077:
        raise ValueError(
            f"{path} may be read by others (mode {mode & 0o777:o}); make it private first: "
            f"chmod 600 {path}"
        )
    token = content.strip()
    if not token:
        raise ValueError(f"{path} is empty; write the token into it")
    return parse_token(token)


def parse_folder(text: str) -> Path | None:
    """An existing folder; empty: not given."""
    if not text.strip():
        return None
    path = Path(text.strip()).expanduser()
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder")
    return path


def parse_paths(text: str) -> tuple[Path, ...]:
    """Comma-separated paths, made absolute (they need not exist)."""
    return tuple(
        Path(part.strip()).expanduser().absolute() for part in text.split(",") if part.strip()
    )


def parse_out_folder(text: str) -> Path:
    """Where shards go: created if missing, so only a path that is a file is refused here."""
    if not text.strip():
        raise ValueError("is empty; give the output folder")
    # Absolute from here on: agents' HOME and CODEX_HOME, rollouts' workdirs and every path
    # handed out are under it, and an agent runs in another working directory.
    path = Path(text.strip()).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a folder")
    return path


def parse_model_map(spec: str) -> list[tuple[str, list[str]]]:
    """``"claude-haiku-*=http://a:8000|http://b:8000,gpt-*=http://c:8000"`` -> rules.

    Each requested model name goes to the servers of the first pattern (fnmatch) it matches;
    names no rule matches go to the policy servers (``agenttap_policy_url``).
    """
    rules: list[tuple[str, list[str]]] = []
    for item in spec.split(","):
        if not item.strip():
            continue
        pattern, sep, urls = item.partition("=")
        servers = [u.strip() for u in urls.split("|") if u.strip()]
        if not sep or not pattern.strip() or not servers:
            raise ValueError(
                f"model map entry {item.strip()!r} is not PATTERN=URL[|URL...] "
                "(e.g. claude-haiku-*=http://127.0.0.1:8001 or =unix:/path/to/vllm.sock)"
            )
        rules.append((pattern.strip(), [parse_policy_url(u).url for u in servers]))
    return rules


# A sandbox's connections at once: more than this is no budget at all (each holds about five
# of mitmdump's descriptors).
MAX_ROLLOUT_CONNECTIONS = 4096


def parse_max_connections(text: str) -> int:
    """A sandbox's connection budget: a whole number from 1 to ``MAX_ROLLOUT_CONNECTIONS``."""
    value = parse_whole(text, positive=True)
    if value > MAX_ROLLOUT_CONNECTIONS:
        raise ValueError(
            f"is more than {MAX_ROLLOUT_CONNECTIONS} (a sandbox's connections at once; each "
            f"holds about five of mitmdump's descriptors)"
        )
    return value


def parse_tolerance(text: str) -> float:
    """A logprob tolerance: a number above 0 (``1e-3``, ``0.05``)."""
    value = float(parse_seconds(text, positive=True))
    if value > 100:
        raise ValueError("is not a logprob tolerance (a number above 0 such as 1e-3)")
    return value
