"""Isolation: how agenttap runs a command it does not trust, importable without the proxy.
``box`` (the facade: ``Box.start(spec) -> BoxHandle``, with ``wait``, ``stop`` and ``usage``),
``engines`` (what a run starts in, by name: ``bwrap``, ``none``, ``podman``), ``containers``
(a run in a container of a task's image: the engine's CLI, the agent brought in from the host),
``hostprog`` (a host program's ELF copy whose interpreter is the host's loader),
``podman`` (the engine's command and configuration), ``images`` (base and task images, built
and cached by content), ``sandbox`` (bubblewrap's
command line from an allowlist of mounts, the sandbox's processes), ``places`` (where a run's
folders appear inside, and the values naming them renamed to match), ``launch`` (bwrap started
as a user that owns nothing; run by path), ``workdir`` (safe workdir copies), ``processes``
(ending every process of a run), ``netbridge`` and ``bridge`` (a sandbox's own network: the
proxy's and the API's ports handed in; ``bridge`` runs inside, by path), ``budget`` (its
connections at once, the descriptor reserve), and the kernel limits by mechanism: ``limits``
(the keys, values and their words), ``host`` (what applies on this host), ``cgroup`` (v1 and v2,
one interface), ``disk`` (a size-capped tmpfs), ``output`` (the log's cap), ``watch`` (the first
limit hit)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "capture.logs.ratelimit",  # nothing else of agenttap: importable without the proxy
)
