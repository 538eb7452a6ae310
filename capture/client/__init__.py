"""A trainer's side: ``launcher`` (``AgentTap``/``AsyncAgentTap``: a mitmdump child per
instance, and ``ControlClient``) and ``ray_pool`` (many instances on Ray). ``capture.launcher``
is the same, kept for users.

May import: ``capture.control.openapi`` (wire constants). It talks to agenttap over HTTP only."""
