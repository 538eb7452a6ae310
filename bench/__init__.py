"""The benchmarks: scripts run as ``python bench/NAME.py`` (or ``python -m bench.NAME``) that
measure agenttap against vLLM, its peers and itself (docs/BENCHMARKS.md); ``common`` holds what
several share, and ``agent_*`` and ``overhead_*`` are the parts of agent_sessions.py and
overhead.py. Each script puts the repository on ``sys.path`` before it imports ``bench.*``.

May import: ``rewriter``, ``capture``, ``tests.support`` (the stubs, the proxies the tests
start, the shared paths). Nothing in ``rewriter``, ``capture`` or ``addons`` imports it."""
