"""OpenAI Responses (``POST /v1/responses``, its SSE stream and WebSocket mode):
everything of its wire format in this folder.

``request``: the wire schema and its translation to the canonical chat form; ``response``: the
answers, the stream writer and the error bodies (both pure: no HTTP framework); ``ids``: the ids
minted for responses and items, read back from what clients resend; ``serving``: the
registered :class:`~rewriter.providers.base.Provider` that serves it (aiohttp glue).
"""

from rewriter.providers.openai_responses import serving

__all__ = ["serving"]
