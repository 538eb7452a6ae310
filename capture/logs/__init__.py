"""Log lines safe to write and bounded in number: agent-chosen text escaped for one line
(``escape``), a repeated failure logged once per interval with a count (``ratelimit``).
Standard library only, so the isolation package and the proxy share them."""

MAY_IMPORT: tuple[str, ...] = ()
