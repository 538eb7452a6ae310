"""Local answers to a scaffold's non-model calls, so it runs offline and nothing leaves the machine.

Claude Code calls api.anthropic.com for feature flags, settings, a bootstrap config, the MCP
registry and telemetry. None of it concerns the policy; each gets the answer of an account with
nothing configured and nothing enabled. Telemetry is accepted and dropped.
"""

from __future__ import annotations

from typing import Any

# (method, path prefix) -> JSON body; first match wins.
_ANTHROPIC: list[tuple[str, str, Any]] = [
    ("POST", "/api/eval/", {"features": {}}),  # feature flags
    ("GET", "/api/claude_code/policy_limits", {"restrictions": {}}),
    ("GET", "/api/claude_code/settings", {}),
    ("GET", "/api/claude_code/organizations/metrics_enabled", {"metrics_logging_enabled": False}),
    ("GET", "/api/claude_code_penguin_mode", {"enabled": False}),
    ("GET", "/api/claude_cli/bootstrap", {}),
    ("GET", "/mcp-registry/", {"servers": [], "metadata": {"count": 0}}),
    ("POST", "/api/event_logging/", {}),
    ("POST", "/api/claude_code/metrics", {}),
]


def local_answer(host: str, method: str, path: str) -> Any | None:
    """The JSON body that answers a non-model call, or None when it is not one we know."""
    if host != "anthropic.com" and not host.endswith(".anthropic.com"):
        return None
    for want_method, prefix, body in _ANTHROPIC:
        if method == want_method and path.startswith(prefix):
            return body
    return None
