"""Rollouts: agenttap runs the agent too. ``runner`` (n agents, each its own session and
sandbox, the verifier, the close), ``spec`` (a ``/rollouts`` request read and checked),
``processes`` (a started agent or verifier, and ending all its processes), ``routes``
(``/rollouts``), ``agents`` (each CLI's headless command line), ``sandbox`` (bubblewrap from an
allowlist, safe workdir copies), ``launch`` (bwrap started as a user that owns nothing),
``netbridge`` and ``bridge`` (a sandbox's own network: the proxy's and the API's ports handed
in, a bridge per agent), ``budget`` (its connections at once, the descriptor reserve),
``limits`` (a run's hard limits: cgroup, tmpfs, prlimit, output), ``harbor_env`` and
``harbor_execd`` (a Harbor environment in a sandbox of its own, imported by Harbor from its own
venv), ``harbor_rollout`` (the ``terminus-2`` agent's script, run in a rollout's sandbox).

May import: ``capture.ports`` (``RolloutHost``), ``capture.control.sessions``,
``capture.control.models``,
``capture.control.endpoints``, ``capture.control.bindings``, ``capture.egress``,
``capture.logsafe``, ``capture.ratelog``. Never ``capture.gateway`` or ``capture.control.api``."""
