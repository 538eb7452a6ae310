"""The policy servers: pools by requested model (``pools``), replicas with affinity, health and
failover (``replicas``), and the start-up checks (``startup``)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.options",  # the settings the start-up check reads
    "rewriter",  # the vLLM client, the template
)
