"""A trainer's side of agenttap's rows, run in the trainer's environment (``.venv-train``,
``scripts/setup_train.sh``; Python 3.11, torch, transformers, TRL, verl where it installs):

- ``rows``: thread rows → what trainers take (the rollout's main row, prompt / completion split,
  masks, weight versions as step numbers, verl's truncation): pure, no torch;
- ``trl``: ``make_rollout_func`` for ``trl.GRPOTrainer(rollout_func=...)`` and the
  ``agenttap_reward`` reward function (no torch or TRL import);
- ``verl``: ``AgentTapAgentLoop``, verl's agent loop registered as ``agenttap``, and
  ``verl_agent_loop.yaml`` (imports verl);
- ``check_logprobs``: ``python -m capture.train.check_logprobs OUT --model DIR``, the HF forward
  against the rows' logprobs (imports torch when it runs);
- ``cpu_attention``, ``trl_cpu``: what makes agent-length rows train on a CPU (torch,
  transformers, TRL).

Trainer libraries are imported inside functions, or by the one module that subclasses theirs
(``verl``), so the proxy's torch-free ``.venv`` imports, type-checks and lints this package."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.client",  # the control API over HTTP
    "capture.storage.reader",
    "capture.storage.row_rules",  # nothing of the proxy itself
)
