"""agenttap's proxy side: the gateway that answers intercepted calls (``gateway``, its
configuration, listeners and base URLs, the ``ports`` to what is built on it), and the folders
below; the top-level re-exports users import or run (``reader``, ``launcher``, ``startup``,
``viewer_http``)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.pipeline",  # the turn
    "capture.policy",  # the policy servers
    "capture.storage",  # sessions, shards; the reader re-exported
    "capture.control.bindings",
    "capture.control.endpoints",
    "capture.control.metrics",
    "capture.control.sessions",  # the control plane's bookkeeping, never its routes
    "capture.logs",
    "rewriter",
    "capture.client.launcher",
    "capture.viewer.http",  # each re-export kept for users: the one module it re-exports
)
