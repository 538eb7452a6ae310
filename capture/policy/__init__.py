"""The policy servers: pools by requested model (``pools``), replicas with affinity, health and
failover (``replicas``), the weight updates (``weights``), generation slots fair between sessions
(``fair``), and the start-up checks (``startup``)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.options",  # the settings the start-up check reads
    "rewriter",  # the vLLM client, the servers' rotation state, the template
)
