"""Rollouts: agenttap runs the agent too. ``runner`` (n agents, each its own session and
sandbox, the verifier, the close), ``spec`` (a ``/rollouts`` request read and checked),
``processes`` (a started agent or verifier, and ending all its processes), ``routes``
(``/rollouts``), ``agents`` (each CLI's headless command line), ``sandbox`` (bubblewrap, safe
workdir copies).

May import: ``capture.ports`` (``RolloutHost``), ``capture.control.sessions``. Never
``capture.gateway`` or ``capture.control.api``."""
