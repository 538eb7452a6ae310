"""Providers: one folder per API wire format, plugged into the gateway through
:mod:`rewriter.providers.base` (read its docstring to add one). Importing this package registers
the built-in providers, in the order the gateway asks them."""

from rewriter.providers import anthropic, gemini, openai_chat, openai_responses
from rewriter.providers.base import Provider, registered

__all__ = ["Provider", "anthropic", "gemini", "openai_chat", "openai_responses", "registered"]
