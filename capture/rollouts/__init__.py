"""Rollouts: agenttap runs the agent too. ``runner`` (``Rollouts``: n agents, each its own
session, run after run, the memory they are promised), ``runs`` (a rollout and its runs, and
what their answers say), ``steps`` (a run's agent and verifier, each in a box of
capture/isolation/), ``closing`` (a run's session closed with its reward, or its rewards taken
back when someone else closed it), ``spec`` (a ``/rollouts`` request read and checked),
``routes`` (``/rollouts``), ``agents`` (the agent catalogue: each CLI's headless command line,
environment and configuration folders), ``admission`` (memory promised to running agents),
``verifier``, ``scoring``, ``grading``, ``pytest_verifier`` and ``pytest_guard`` (the
verifier's spec, its reward, what of the agent's it sees), ``harbor_env`` (the old import path
of capture/harbor/env.py's Harbor environment).

May import: ``capture.ports`` (``RolloutHost``, ``REWARD_VERIFIER``), ``capture.isolation``,
``capture.harbor`` (``harbor_env`` only), ``capture.control.sessions``, ``capture.control.models``,
``capture.egress``, ``capture.logsafe``. Never ``capture.gateway``, ``capture.storage`` or
``capture.control.api``."""
