"""The trajectory viewer: its data, pure (``data`` gathers ``sources``, ``session_list``,
``run``, ``tree``, ``tokens``, ``diff``), served over HTTP (``http``: live from a running proxy,
or offline over OUT) with the page in ``ui/``."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.ports",  # GatewayCore
    "capture.storage",
    "rewriter",  # the tokenizer, the output parsers; never the gateway
)
