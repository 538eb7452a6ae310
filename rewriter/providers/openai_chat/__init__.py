"""OpenAI Chat Completions (``POST /v1/chat/completions``):
everything of its wire format in this folder.

``request``: the wire schema and its translation to the canonical chat form; ``response``: the
answers, the stream writer and the error bodies (both pure: no HTTP framework); ``serving``: the
registered :class:`~rewriter.providers.base.Provider` that serves it (aiohttp glue).
"""

from rewriter.providers.openai_chat import serving

__all__ = ["serving"]
