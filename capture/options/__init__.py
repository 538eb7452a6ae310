"""agenttap's options: declared once, parsed once, by pure functions.

mitmproxy parses an addon's typed options itself, and a value it cannot parse (``--set
agenttap_responses_websocket=no`` for a bool, ``--set agenttap_hosts`` with no value for a text
option) makes it skip the whole addon and run on as a plain forwarding proxy: the agent's call,
API key included, would go to the real provider. So every agenttap option is declared to
mitmproxy as text, and its value is parsed here, by pure parsers. Each parser raises
``ValueError`` worded for the user (the addon turns it into an ``OptionsError``, or refuses
every flow); nothing here knows mitmproxy.

Values users naturally write are read: YAML numbers and booleans in ``config.yaml``, and
``true/false/yes/no/on/off/1/0`` for switches.

``declared`` (every option: name, default, help, parser; ``all_options``), ``values`` (the pure
parsers of one value), ``reading`` (a raw value as checked text, the errors a user reads),
``settings`` (the typed ``Settings`` and ``parse_settings``). The names most callers want are
re-exported here."""

from __future__ import annotations

from capture.options.declared import Option, all_options
from capture.options.settings import Settings, parse_settings

__all__ = ["Option", "Settings", "all_options", "parse_settings"]

# What this package's modules may import besides their own package's (scripts/house.py;
# tests/unit/test_import_graph.py holds every import to it).
MAY_IMPORT: tuple[str, ...] = (
    "rewriter",  # the providers' own options, the parser names, policy URLs
)
