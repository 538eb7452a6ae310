"""The vLLM policy servers behind the proxy: replicas, failover, weight updates and versions,
start-up checks, the private (embedded) policy and scripts/run_proxy.sh."""
