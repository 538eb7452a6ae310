"""Where clients reach an agenttap instance, as handed to them: a session's environment for
proxy mode (``Endpoints.env``: the proxy with the session's secret, the CA under every name the
clients read it from, the secret as every API key), its base URLs, and the CA bundle written
beside the proxy's CA. Plain data and one file write: no HTTP."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Dummy keys under every name the clients read: each insists on one, none reaches a provider.
DUMMY_KEYS = {
    "OPENAI_API_KEY": "sk-agenttap",
    "ANTHROPIC_API_KEY": "sk-ant-agenttap",
    "GEMINI_API_KEY": "agenttap",
    "GOOGLE_API_KEY": "agenttap",
    "GOOGLE_GENERATIVE_AI_API_KEY": "agenttap",  # OpenCode's Gemini provider
}


@dataclass(frozen=True)
class Endpoints:
    """Where clients reach this instance, as handed to them (advertised host)."""

    # http://HOST:PORT of the API listener (control API, base URLs).
    api_url: str
    # http://HOST:PORT of the proxy (mitmdump's listener); empty when not known.
    proxy_url: str
    # The CA certificate clients must trust in proxy mode.
    ca_path: str
    # The system's CAs plus ca_path (see write_ca_bundle): for clients whose CA variable
    # replaces the system's, so passthrough hosts' real certificates are trusted too.
    bundle_path: str = ""

    def base_urls(self, session_id: str) -> dict[str, str]:
        prefix = f"{self.api_url}/sess/{session_id}"
        return {
            "openai": f"{prefix}/v1",
            "anthropic": f"{prefix}/anthropic",
            "gemini": f"{prefix}/gemini",
        }

    def env(self, session_id: str, secret: str = "") -> dict[str, str]:
        """What a client needs in proxy mode: the proxy with the session as its username and
        its ``secret`` as the password, the CA under each variable a client reads it from, the
        secret as every API key (base-URL mode: the key is the secret), headless switches.
        Without a secret (a session never opened): ``x`` and dummy keys."""
        env: dict[str, str] = {"AGENTTAP_SESSION": session_id}
        if self.proxy_url:
            scheme, _, hostport = self.proxy_url.partition("://")
            proxy = f"{scheme}://{session_id}:{secret or 'x'}@{hostport}"
            env.update(HTTPS_PROXY=proxy, https_proxy=proxy)
            env.update(NO_PROXY="localhost,127.0.0.1,::1", no_proxy="localhost,127.0.0.1,::1")
        if self.ca_path:
            # Node adds NODE_EXTRA_CA_CERTS to its own CAs; the others replace theirs, so they
            # get the bundle (the system's CAs too: passthrough hosts keep working).
            bundle = self.bundle_path or self.ca_path
            env["NODE_EXTRA_CA_CERTS"] = self.ca_path  # Claude Code, Gemini CLI, Node SDKs
            for name in (
                "SSL_CERT_FILE",  # Python (httpx, ssl), Codex
                "REQUESTS_CA_BUNDLE",  # requests
                "CODEX_CA_CERTIFICATE",  # Codex
                "CURL_CA_BUNDLE",  # curl, git
                "GIT_SSL_CAINFO",  # git
                "PIP_CERT",  # pip
            ):
                env[name] = bundle
        env.update({name: secret for name in DUMMY_KEYS} if secret else DUMMY_KEYS)
        # Headless runs: no side traffic from Claude Code, no trust prompt from Gemini CLI.
        env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
        env["GEMINI_CLI_TRUST_WORKSPACE"] = "true"
        return env


SYSTEM_CA_FILES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def write_ca_bundle(ca_path: Path) -> Path:
    """``agenttap-ca-bundle.pem`` beside the proxy's CA: the system's CAs (certifi's where the
    system has none) followed by the proxy's. Written whole, then renamed into place."""
    system = next((Path(p) for p in SYSTEM_CA_FILES if Path(p).is_file()), None)
    if system is None:
        import certifi

        system = Path(certifi.where())
    bundle = ca_path.with_name("agenttap-ca-bundle.pem")
    tmp = bundle.with_name(f".{bundle.name}.{os.getpid()}.tmp")
    tmp.write_bytes(system.read_bytes().rstrip(b"\n") + b"\n" + ca_path.read_bytes())
    os.replace(tmp, bundle)
    return bundle
