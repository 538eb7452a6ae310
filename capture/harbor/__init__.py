"""The Harbor integration: ``env`` (a Harbor environment in a bubblewrap sandbox of its own,
``--env capture.harbor.env:SandboxEnvironment``, imported by Harbor from its own venv,
``.venv-harbor``), ``execd`` (its exec server, run inside that sandbox by path) and ``rollout``
(the ``terminus-2`` rollout agent's script, run by path in a rollout's sandbox with Harbor's
Python)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.isolation.sandbox",
    "capture.isolation.workdir",  # standard library only: Harbor's venv has nothing of the proxy
)
