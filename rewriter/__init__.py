"""The provider side: each provider's wire format parsed into canonical chat and answered back
(``providers/``), the chat template and tokens (``template``, ``canonical``, ``parsers``), and the
token-in/token-out client of a vLLM policy server (``vllm_client`` and the modules it is put
together from: ``vllm_transport``, ``vllm_probe``, ``vllm_generate``, ``vllm_resume``,
``vllm_scoring``, ``vllm_rotation``, ``vllm_request``, ``vllm_answers``, ``vllm_stream``) with its
address (``policy_url``). What runs inside vLLM, and the launcher that starts it, is
``policy_server/``. Besides the standard library, only the proxy's dependencies (aiohttp,
tokenizers, transformers, jinja2, orjson, pydantic)."""

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = ()
