"""OpenAI Responses (``POST /v1/responses``, its SSE stream and WebSocket mode):
everything of its wire format in this folder.

``protocol``: the wire schema and translation to and from the canonical chat form, its response
and stream builders and error bodies (pure: no HTTP framework); ``serving``: the registered
:class:`~rewriter.providers.base.Provider` that serves it (aiohttp glue).
"""

from rewriter.providers.openai_responses import serving

__all__ = ["serving"]
