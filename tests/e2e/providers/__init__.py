"""A provider's wire format through a real mitmdump: the SDKs against the stub or the real vLLM,
streaming, headers, flow replay, trajectories and conservation of tokens."""
