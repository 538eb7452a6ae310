"""OpenAI Chat Completions (``POST /v1/chat/completions``):
everything of its wire format in this folder.

``protocol``: the wire schema and translation to and from the canonical chat form, its response
and stream builders and error bodies (pure: no HTTP framework); ``serving``: the registered
:class:`~rewriter.providers.base.Provider` that serves it (aiohttp glue).
"""

from rewriter.providers.openai_chat import serving

__all__ = ["serving"]
