"""Bad input, an adversarial agent, fail-closed options and resource attacks: what the proxy
must refuse or survive without stalling, leaking or losing rows."""
