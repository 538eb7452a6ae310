"""Rollouts: agenttap runs the agent too. ``runner`` (n agents, each its own session and
sandbox, the verifier, the close), ``routes`` (``/rollouts``), ``agents`` (each CLI's headless
command line), ``sandbox`` (bubblewrap, safe workdir copies).

May import: ``capture.ports`` (``RolloutHost``), ``capture.control.sessions``. Never
``capture.gateway`` or ``capture.control.api``."""
