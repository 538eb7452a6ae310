"""The turn: one intercepted call from its request to its recorded row. ``turn`` (the
``TurnPipeline``: placement in the session's tree, the policy, the provider's writer, the
record), ``recording`` (the turn's record step, the calls' log lines), ``bodies`` (request heads
and bodies, bounded), ``session_ids`` (which session a call is, its credentials), ``handoff``
(the headers the addon hands a call to the gateway with, and takes back), ``providers`` (which
provider answers a call; a WebSocket's turns checked again), ``whitebox`` (token ids in, a turn
out)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.trajectory",
    "capture.storage",
    "capture.policy",
    "capture.control.bindings",
    "capture.control.metrics",
    "capture.control.sessions",  # bookkeeping; never the control API, rollouts, the viewer
    "capture.logs",
    "rewriter",
)
