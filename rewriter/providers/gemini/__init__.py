"""The Gemini API (``generateContent``, ``streamGenerateContent``, ``countTokens``):
everything of its wire format in this folder.

``routes``: the model and method in the URL; ``fields`` and ``schemas``: reading a request's
fields and its OpenAPI schemas; ``request``: the wire schema and its translation to the canonical
chat form; ``response``: the answers, the stream writer and the error bodies (all pure: no HTTP
framework); ``serving``: the registered :class:`~rewriter.providers.base.Provider` that serves it
(aiohttp glue).
"""

from rewriter.providers.gemini import serving

__all__ = ["serving"]
