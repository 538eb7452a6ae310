"""A trainer's side: ``launcher`` (``AgentTap``/``AsyncAgentTap``: a mitmdump child per
instance, and ``ControlClient``) and ``ray_pool`` (many instances on Ray: the driver's
``ProxyPool``; ``proxy_actor``, the actor each runs; ``pool_shards``, their shards uploaded and
read back as one dataset; ``pool_groups``, its rollout methods; ``pool_rollouts``, one group
of rollouts placed across the nodes and watched for node loss; ``shipping``, the folders a
rollout takes to its node).
``capture.launcher`` is the same, kept for users."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.control.media",  # the media types (constants; the client talks HTTP only)
    "capture.train.probe",  # the weights probe, imported when a check runs
    "capture.isolation.limits",  # a rollout's limit defaults, for placing it on a node (stdlib)
)
