"""Helpers the tests share (no tests here): paths, proxies, the stub policy, the session's vLLM
servers, fuzzing and hostile inputs; some also run as scripts (in .venv-train and others)."""
