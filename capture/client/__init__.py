"""A trainer's side: ``launcher`` (``AgentTap``/``AsyncAgentTap``: a mitmdump child per
instance, and ``ControlClient``) and ``ray_pool`` (many instances on Ray: the driver's
``ProxyPool``; ``proxy_actor``, the actor each runs; ``pool_shards``, their shards uploaded and
read back as one dataset). ``capture.launcher`` is the same, kept for users.

May import: ``capture.control.openapi`` (wire constants). It talks to agenttap over HTTP only."""
