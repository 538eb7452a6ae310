"""The policy servers: pools by requested model (``pools``), replicas with affinity, health and
failover (``replicas``), and the start-up checks (``startup``).

May import: ``rewriter`` (the vLLM client, the servers' rotation state), ``capture.options``
(the settings the start-up check reads). Nothing of the gateway, the control plane or storage."""
