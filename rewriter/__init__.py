"""The provider side: each provider's wire format parsed into canonical chat and answered back
(``providers/``), the chat template and tokens (``template``, ``canonical``, ``parsers``), and the
token-in/token-out client of a vLLM policy server (``vllm_client`` and the modules it is put
together from: ``vllm_transport``, ``vllm_probe``, ``vllm_generate``, ``vllm_resume``,
``vllm_scoring``, ``vllm_rotation``, ``vllm_request``, ``vllm_answers``, ``vllm_stream``) with its
address (``policy_url``). What runs inside vLLM, and the launcher that starts it, is
``policy_server/``.

May import: the standard library and the proxy's dependencies (aiohttp, tokenizers,
transformers, jinja2, orjson, pydantic). Nothing of ``capture``, ``addons`` or
``policy_server``."""
