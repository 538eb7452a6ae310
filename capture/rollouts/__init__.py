"""Rollouts: agenttap runs the agent too. ``runner`` (``Rollouts``: n agents, each its own
session, run after run, the memory they are promised), ``runs`` (a rollout and its runs, and
what their answers say), ``steps`` (a run's agent and verifier, each in a box of
capture/isolation/), ``closing`` (a run's session closed with its reward, or its rewards taken
back when someone else closed it), ``spec`` (a ``/rollouts`` request read and checked),
``routes`` (``/rollouts``), ``images`` (a rollout in its task's own image: what the agent and the
verifier start from), ``agents`` (the agent catalogue: each CLI's headless command line,
environment and configuration folders), ``admission`` (memory promised to running agents),
``verifier``, ``scoring``, ``grading``, ``pytest_verifier`` and ``pytest_guard`` (the
verifier's spec, its reward, what of the agent's it sees), ``harbor_env`` (the old import path
of capture/harbor/env.py's Harbor environment)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.ports",  # RolloutHost, REWARD_VERIFIER
    "capture.isolation",  # the Box the runner starts
    "capture.harbor.env",  # the old module name kept
    "capture.harbor.task",  # a Harbor task folder read
    "capture.control.sessions",
    "capture.control.models",  # the body models' shared checks
    "capture.egress",
    "capture.logs",
)
