"""The HTTP control plane a trainer drives: the routes (``api``; their table and the token
check in ``routing``; ``/replicas`` in ``replica_routes``), the request bodies' pydantic models
(``models``), what they answer with (``answers``: the error body, a session's rows as
JSON or Arrow), their OpenAPI document (``openapi``), session bookkeeping (``sessions``: limits,
metrics, secrets; ``bindings``: the session each connection out of a sandbox is bound to),
Prometheus ``metrics``, where clients reach an instance (``endpoints``), the start-up
``banner``."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.ports",  # the gateway, seen as GatewayCore
    "capture.storage",
    "capture.rollouts",
    "capture.isolation",
    "capture.viewer",
    "capture.options",
    "capture.policy.weights",  # the weight update's types
    "capture.logs",
    "rewriter",
)
