"""The turn: one intercepted call from its request to its recorded row. ``turn`` (the
``TurnPipeline``: placement in the session's tree, the policy, the provider's writer, the
record), ``recording`` (the turn's record step, the calls' log lines), ``bodies`` (request heads
and bodies, bounded), ``session_ids`` (which session a call is, its credentials), ``handoff``
(the headers the addon hands a call to the gateway with, and takes back), ``providers`` (which
provider answers a call; a WebSocket's turns checked again), ``whitebox`` (token ids in, a turn
out).

May import: ``capture.trajectory``, ``capture.storage``, ``capture.policy``, ``capture.control``'s
session bookkeeping and metrics, ``rewriter``. Never the gateway, the control API, rollouts or
the viewer."""
