"""The proxy's start-up lines for a person: what to copy for each client family, and the one
``agenttap ready:`` line printed once both listeners accept connections (addons/capture.py).

The ``AGENTTAP_*=`` lines tools parse come from ``capture.control.api.banner_lines``; this
module replaces only its generic proxy-mode and API-key lines with one line per client family."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from capture.control.endpoints import Endpoints

# banner_lines' lines that the per-family lines below say better (and with the CA bundle where
# a client's CA variable replaces the system's).
REPLACED_PREFIXES = ("Proxy mode:", "API keys:")

# Client families: their label, the variables (from Endpoints.env) each needs in proxy mode,
# and switches of their own (LiteLLM fetches its price list at import unless told to use its
# copy; mini-swe-agent asks for a setup wizard; OpenHands reads its model from LLM_MODEL).
FAMILIES: tuple[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]], ...] = (
    (
        "Claude Code, Gemini CLI, OpenCode, Node SDKs",
        ("HTTPS_PROXY", "NODE_EXTRA_CA_CERTS", "ANTHROPIC_API_KEY", "GEMINI_API_KEY"),
        (),
    ),
    (
        "Codex CLI",
        ("HTTPS_PROXY", "SSL_CERT_FILE", "CODEX_CA_CERTIFICATE", "OPENAI_API_KEY"),
        (),
    ),
    (
        "Python SDKs (openai, anthropic, google-genai)",
        ("HTTPS_PROXY", "SSL_CERT_FILE", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GOOGLE_API_KEY"),
        (),
    ),
    (
        "LiteLLM scaffolds (mini-swe-agent, OpenHands, Terminus-2; docs/PROVIDERS.md)",
        ("HTTPS_PROXY", "SSL_CERT_FILE", "OPENAI_API_KEY"),
        (
            ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
            ("MSWEA_CONFIGURED", "true"),
            ("LLM_MODEL", "openai/gpt-4o"),
            ("LLM_API_KEY", "anything"),
        ),
    ),
)


def start_lines(banner: Iterable[str], endpoints: Endpoints) -> list[str]:
    """``banner`` (banner_lines) with its generic proxy lines replaced, where they stood, by one
    ``export`` line per client family (SESSION names the session; any API key works)."""
    families = family_lines(endpoints)
    lines: list[str] = []
    for line in banner:
        if line.startswith(REPLACED_PREFIXES):
            lines += families
            families = []
        else:
            lines.append(line)
    return lines + families


def family_lines(endpoints: Endpoints) -> list[str]:
    env = endpoints.env("SESSION")
    if not env.get("HTTPS_PROXY"):
        return []  # the proxy's address is not known: base-URL mode only
    lines = ["Proxy mode, per client (SESSION names the session; any API key works):"]
    for label, names, fixed in FAMILIES:
        values = [(name, env[name]) for name in names if env.get(name)] + list(fixed)
        exports = " ".join(f"{name}={value}" for name, value in values)
        lines += [f"  {label}:", f"    export {exports}"]
    return lines


def ready_line(proxy_url: str, hosts: Iterable[str], policy_urls: Iterable[str]) -> str:
    """The last start-up line, printed once the proxy and the API listener accept connections."""
    return (
        f"agenttap ready: proxy {proxy_url} answering {', '.join(sorted(hosts))} "
        f"from {', '.join(policy_urls)}"
    )


def export_line(api_url: str, token: str, tokenizer: str, policy_url: str = "") -> str:
    """One line a shell sources as printed (``eval "$(... | grep '^export AGENTTAP_')"``, or
    copied): the control API, its token, the policy's tokenizer and, given, the policy's URL
    (``POLICY_URL``: what a trainer's own ``AgentTap.start`` or weight check points at; the
    embedded policy's is a unix socket no one could guess). Printed to standard output alone,
    without the log's timestamp, and never into a file of agenttap's."""
    values = {"AGENTTAP_API": api_url, "AGENTTAP_TOKEN": token, "AGENTTAP_TOKENIZER": tokenizer}
    if policy_url:
        values["POLICY_URL"] = policy_url
    return "export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in values.items())
