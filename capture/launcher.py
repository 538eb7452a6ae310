"""``capture.launcher``, as users import it: the same as ``capture.client.launcher``."""

from capture.client.launcher import (
    AgentTap,
    AgentTapError,
    AsyncAgentTap,
    ControlClient,
    Session,
    parse_banner,
)

__all__ = ["AgentTap", "AgentTapError", "AsyncAgentTap", "ControlClient", "Session", "parse_banner"]
