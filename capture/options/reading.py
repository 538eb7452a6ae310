"""How an option's raw value becomes checked text, and the errors a user reads about it.

mitmproxy hands a value over as ``--set`` strings or a ``config.yaml`` scalar; ``as_text`` makes it
one text, ``parse_value`` reads it with its option's parser, and every error names the option,
what was given (never a secret's value) and what the option takes. ``check_deferred`` does this
for the values mitmproxy holds back until an addon has declared its options."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

from capture.options.declared import SECRET_OPTIONS, Option


def as_text(value: Any) -> str:
    """An option value as mitmproxy hands it over, as one text: ``--set`` values come as a list
    of strings (empty: the name with no value; two: given twice), ``config.yaml`` values as
    YAML scalars (numbers, booleans, null)."""
    values = getattr(value, "val", None)  # mitmproxy's _UnconvertedStrings from --set
    if values is not None:
        if len(values) == 0:
            raise ValueError("has no value")
        if len(values) > 1:
            raise ValueError("given more than once; set it once")
        value = values[0]
    if value is None:
        raise ValueError("has no value")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return value
    raise ValueError(f"must be text, a number or true/false, not {type(value).__name__}")


def describe(option: Option, text: str | None, problem: str) -> str:
    """The error a user reads: which option, what was given, what it accepts. ``text`` None:
    the value itself could not be read (no value, given twice)."""
    if text is None or option.name in SECRET_OPTIONS:
        given = option.name  # a secret's value is never echoed into a log
    else:
        shown = text if len(text) <= 80 else text[:77] + "..."
        plain = shown and all(c.isalnum() or c in "-_.:/,|*=" for c in shown)
        given = f"{option.name}={shown if plain else repr(shown)}"
    default = f" (the default is --set {option.name}={option.default})" if option.default else ""
    return f"agenttap: --set {given} {problem}. It takes: {option.help}{default}"


def unknown_names(names: Iterable[str], known: Iterable[str]) -> str | None:
    """An error naming the misspelled agenttap options among ``names``, or None."""
    known_set = set(known)
    unknown = sorted(n for n in names if n.startswith("agenttap") and n not in known_set)
    if not unknown:
        return None
    return (
        f"agenttap: unknown option(s) {', '.join(unknown)}; agenttap's options are: "
        + ", ".join(sorted(known_set))
    )


def parse_value(option: Option, text: str) -> Any:
    try:
        return option.parse(text)
    except ValueError as exc:
        raise ValueError(describe(option, text, str(exc))) from None


def check_deferred(deferred: MutableMapping[str, Any], options: Mapping[str, Option]) -> list[str]:
    """Take every agenttap value out of ``deferred`` (mitmproxy's values of options not declared
    yet) and put each back as one checked text; what could not be read stays out, and its
    error is among those returned (a misspelled name's too)."""
    problems = []
    unknown = unknown_names(deferred, options)
    if unknown:
        problems.append(unknown)
    for name in [n for n in deferred if n.startswith("agenttap")]:
        value = deferred.pop(name)
        option = options.get(name)
        if option is None:
            continue  # named in `unknown`
        try:
            text = as_text(value)
        except ValueError as exc:
            problems.append(describe(option, None, str(exc)))
            continue
        try:
            parse_value(option, text)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        deferred[name] = text
    return problems
