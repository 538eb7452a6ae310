"""The Harbor integration: ``env`` (a Harbor environment in a bubblewrap sandbox of its own,
``--env capture.harbor.env:SandboxEnvironment``, imported by Harbor from its own venv,
``.venv-harbor``), ``execd`` (its exec server, run inside that sandbox by path) and ``rollout``
(the ``terminus-2`` rollout agent's script, run by path in a rollout's sandbox with Harbor's
Python).

May import: ``capture.isolation.sandbox`` and ``capture.isolation.workdir`` (standard library
only), Harbor's own package. Nothing of the proxy: Harbor's venv does not have it."""
