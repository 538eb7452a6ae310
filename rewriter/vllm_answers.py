"""vLLM's answers as this proxy reads them: completions and their streamed pieces, the sampling
parameters sent, and the shape checks that turn anything else into a :class:`PolicyError`
(garbage, wrong types, non-finite logprobs) instead of a crash or silence. No HTTP here."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from rewriter.canonical import SamplingParams

# (version, start, end): output tokens [start, end) were sampled by weights labelled version.
WeightSpan = tuple[str, int, int]


class PolicyError(RuntimeError):
    """The policy server failed or refused a request.

    ``status`` is the server's HTTP status, 0 when it did not answer.
    """

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

    @property
    def unavailable(self) -> bool:
        """Down, overloaded or refusing for now (no answer, 429, 503): worth a retry later."""
        return self.status in (0, 429, 503)


@dataclass
class CompletionDelta:
    """A piece of a completion: new text, the token ids behind it and their logprobs.

    ``weight_versions``: spans over the completion's token indexes (not the piece's), as the
    generate endpoint reports them on a generation's last piece; empty when unknown.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[WeightSpan] = field(default_factory=list)
    # The policy server that sampled this piece ("" when not known).
    backend: str = ""
    # Another piece came in the same read and follows at once: a writer may hold this one's
    # bytes and send them with the next.
    more: bool = False


def coalesce(pieces: list[CompletionDelta]) -> list[CompletionDelta]:
    """The pieces of one read as few as can be: a run of pieces becomes one, with their texts,
    ids, logprobs and weight spans one after the other (what vLLM itself sends when it lags
    behind: several tokens in a chunk). A run ends at a piece with a finish reason, so what
    follows an abort or a finish stays apart. Extending a :class:`Completion` by the result
    gives the same completion as by ``pieces``; the client gets one event where it would have
    got one per token, while the proxy was busy or the client slow."""
    if len(pieces) < 2:
        return pieces
    out: list[CompletionDelta] = []
    run: list[CompletionDelta] = []
    for piece in pieces:
        run.append(piece)
        if piece.finish_reason is not None:
            out.append(_joined(run))
            run = []
    if run:
        out.append(_joined(run))
    return out


def _joined(run: list[CompletionDelta]) -> CompletionDelta:
    if len(run) == 1:
        return run[0]
    last = run[-1]
    ids: list[int] = []
    logprobs: list[float] = []
    spans: list[WeightSpan] = []
    for piece in run:
        ids += piece.token_ids
        logprobs += piece.logprobs
        spans += piece.weight_versions
    return CompletionDelta(
        "".join(piece.text for piece in run),
        ids,
        logprobs,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        weight_versions=spans,
        backend=last.backend,
    )


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    # Which weights sampled which tokens: (version, start, end) over token_ids; empty: unknown.
    weight_versions: list[WeightSpan] = field(default_factory=list)
    # Which server sampled which tokens: (backend, start, end) over token_ids; more than one
    # where a generation moved to another server after its first failed (failover).
    backends: list[tuple[str, int, int]] = field(default_factory=list)

    def extend(self, delta: CompletionDelta) -> None:
        if delta.backend:
            start, end = len(self.token_ids), len(self.token_ids) + len(delta.token_ids)
            last = self.backends[-1] if self.backends else None
            if last is not None and last[0] == delta.backend and last[2] == start:
                self.backends[-1] = (delta.backend, last[1], end)
            elif end > start or not self.backends:
                self.backends.append((delta.backend, start, end))
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        for version, start, end in delta.weight_versions:
            last = self.weight_versions[-1] if self.weight_versions else None
            if last is not None and last[0] == version and last[2] == start:
                # A generation resumed under the same weights: one span.
                self.weight_versions[-1] = (version, last[1], end)
            else:
                self.weight_versions.append((version, start, end))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


def sampling_to_vllm(params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_tokens", "seed", "ignore_eos"):
        value = getattr(params, name)
        if value is not None:
            body[name] = value
    if params.stop:
        body["stop"] = list(params.stop)
    if params.json_schema is not None:
        body["structured_outputs"] = {"json": params.json_schema}
    return body


def completions_delta(choice: dict[str, Any]) -> CompletionDelta:
    """A choice of ``/v1/completions``: its ids in ``token_ids`` (``return_token_ids``) or,
    where that is null, in ``logprobs.tokens`` (``return_tokens_as_token_ids``: what
    generation_body asks for)."""
    lp = typed_field(choice, "logprobs", dict) or {}
    values = typed_field(lp, "token_logprobs", list) or []
    # Called for every streamed token: a float (nearly every logprob) is taken as it is.
    logprobs = [x if type(x) is float else checked_logprob(x) for x in values]
    if choice.get("token_ids") is None and "tokens" in lp:
        return answer_delta(choice, logprobs, [], tokens_as_ids(lp["tokens"]))
    return answer_delta(choice, logprobs, [])


TOKEN_ID_PREFIX = "token_id:"
_ID_LIMIT = 2**31


def completions_stream_line(payload: bytes) -> list[CompletionDelta] | None:
    """A ``/v1/completions`` stream line as vLLM writes it, read in one pass: its choices'
    pieces, exactly as ``completions_delta`` of ``answer_choices(answer_json(...))`` reads
    them. None where the line is anything else (an error, a wrong type, a number orjson reads
    otherwise than Python's json, a prompt's echo): the careful path then reads it, and says
    what is wrong. Called for every streamed token, so every check here is a type test."""
    if len(payload) >= _ECHO_WORTH_CUTTING:
        return None
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if type(data) is not dict or "error" in data:
        return None
    choices = data.get("choices")
    if not choices:
        return [] if choices is None or choices == [] else None
    if type(choices) is not list:
        return None
    pieces: list[CompletionDelta] = []
    for choice in choices:
        if type(choice) is not dict:
            return None
        lp = choice.get("logprobs")
        if lp is None:
            lp = {}
        elif type(lp) is not dict:
            return None
        logprobs = lp.get("token_logprobs")
        if logprobs is None:
            logprobs = []
        elif type(logprobs) is not list:
            return None
        for value in logprobs:
            if type(value) is not float:
                return None  # null or an integer: the careful path turns it into a float
        ids = choice.get("token_ids")
        if ids is None and "tokens" in lp:
            try:
                ids = tokens_as_ids(lp["tokens"])
            except PolicyError:
                return None
            if ids and max(ids) >= _ID_LIMIT:
                return None
        elif ids is None:
            ids = []
        elif type(ids) is not list or not are_token_ids(ids):
            return None
        if len(ids) != len(logprobs):
            return None
        text = choice.get("text")
        if text is None:
            text = ""
        elif type(text) is not str:
            return None
        finish = choice.get("finish_reason")
        stop = choice.get("stop_reason")
        if (finish is not None and type(finish) is not str) or (
            stop is not None and type(stop) is not str and type(stop) is not int
        ):
            return None
        pieces.append(CompletionDelta(text, ids, logprobs, finish, stop))
    return pieces


def tokens_as_ids(tokens: Any) -> list[int]:
    """``["token_id:9315", ...]`` (vLLM's ``return_tokens_as_token_ids``) -> ``[9315, ...]``."""
    if not isinstance(tokens, list):
        raise malformed_answer("a 'tokens' of the wrong type", tokens)
    ids: list[int] = []
    for token in tokens:
        if not (isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX)):
            raise malformed_answer("a token that is not 'token_id:N'", token)
        digits = token[len(TOKEN_ID_PREFIX) :]
        if not (digits.isascii() and digits.isdigit() and len(digits) <= 10):
            raise malformed_answer("a token that is not 'token_id:N'", token)
        ids.append(int(digits))
    return ids


def generate_delta(choice: dict[str, Any]) -> CompletionDelta:
    """A choice of ``/inference/v1/generate`` (``output_mode: text``); spans are the part's."""
    content = typed_field(typed_field(choice, "logprobs", dict) or {}, "content", list) or []
    entries = [answer_object(x, "a logprobs.content entry") for x in content]
    logprobs = [checked_logprob(x.get("logprob", 0.0)) for x in entries]
    spans: list[WeightSpan] = []
    for span in typed_field(choice, "weight_versions", list) or []:
        span = answer_object(span, "a weight_versions span")
        start, end = span.get("start"), span.get("end")
        if not (isinstance(start, int) and isinstance(end, int)) or span.get("version") is None:
            raise malformed_answer("a weight_versions span without version, start and end", span)
        spans.append((str(span["version"]), int(start), int(end)))
    return answer_delta(choice, logprobs, spans)


def are_token_ids(values: list[Any]) -> bool:
    """Every value a token id: an int (not a bool) in [0, 2**31)."""
    return all(is_int(x) and 0 <= x < _ID_LIMIT for x in values)


def answer_delta(
    choice: dict[str, Any],
    logprobs: list[float],
    spans: list[WeightSpan],
    ids: list[int] | None = None,
) -> CompletionDelta:
    """The fields both endpoints spell alike, with the logprobs and spans (and, where not in
    ``token_ids``, the ids, as ``tokens_as_ids`` reads them) each spells its way."""
    if ids is None:
        ids = typed_field(choice, "token_ids", list) or []
        if not are_token_ids(ids):
            raise malformed_answer("token_ids that are not token ids", ids)
    elif ids and max(ids) >= _ID_LIMIT:  # tokens_as_ids's: ints, none negative
        raise malformed_answer("token_ids that are not token ids", ids)
    if len(logprobs) != len(ids):
        raise PolicyError(
            f"policy returned {len(ids)} token ids but {len(logprobs)} logprobs; "
            "is it a vLLM server that returns token ids?",
            BAD_ANSWER,
        )
    stop_reason = choice.get("stop_reason")
    if stop_reason is not None and not isinstance(stop_reason, str) and not is_int(stop_reason):
        raise malformed_answer("a stop_reason that is neither text nor a token id", stop_reason)
    return CompletionDelta(
        text=typed_field(choice, "text", str) or "",
        token_ids=ids,
        logprobs=logprobs,
        finish_reason=typed_field(choice, "finish_reason", str),
        stop_reason=stop_reason,
        weight_versions=spans,
    )


# The status a PolicyError carries when the policy answered 200 with something that is not a
# vLLM answer (garbage, wrong types): the providers answer it as their server error, not as
# "unavailable, retry".
BAD_ANSWER = 502


def snippet(value: Any) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else repr(value)
    return text if len(text) <= 120 else text[:120] + "..."


def malformed_answer(what: str, value: Any) -> PolicyError:
    return PolicyError(
        f"the policy server sent {what} ({snippet(value)}); is it a vLLM server, and healthy?",
        BAD_ANSWER,
    )


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def answer_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise malformed_answer(f"{what} that is not a JSON object", value)
    return value


def typed_field(obj: dict[str, Any], name: str, kind: type) -> Any:
    """``obj[name]`` if absent, null or of type ``kind``; else the policy's answer is garbage."""
    value = obj.get(name)
    if value is not None and not isinstance(value, kind):
        raise malformed_answer(f"a {name!r} of the wrong type", value)
    return value


def checked_logprob(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise malformed_answer("a logprob that is not a number", value)
    return float(value)


def answer_choices(data: Any) -> list[dict[str, Any]]:
    """The choices of one answer (a whole body or a stream's chunk), checked for shape."""
    data = answer_object(data, "an answer")
    if "error" in data:
        raise PolicyError(f"policy stream failed: {snippet(data['error'])}")
    choices = typed_field(data, "choices", list) or []
    return [answer_object(c, "a choice") for c in choices]


# vLLM echoes the prompt's ids in every whole answer and in a stream's first chunk; they are the
# ids agenttap sent, never read, and parsing them (tens of thousands of ints) would be most of
# the answer's cost. A JSON key is the only place this pattern can occur (a string value's
# quotes are escaped), and only a plain list of ints is cut.
_PROMPT_IDS_KEY = re.compile(rb'"prompt_token_ids"\s*:\s*\[')
_ECHO_WORTH_CUTTING = 4096  # bytes of answer: below it, parsing the echo costs next to nothing


def without_prompt_echo(raw: bytes) -> bytes:
    """``raw`` with its first ``"prompt_token_ids": [...]`` list of ints made ``null``."""
    if len(raw) < _ECHO_WORTH_CUTTING:
        return raw
    key = _PROMPT_IDS_KEY.search(raw)
    if key is None:
        return raw
    end = raw.find(b"]", key.end())
    if end < 0 or raw[key.end() : end].translate(None, b"0123456789, \t\r\n"):
        return raw  # not a plain list of ints: parsed as it is
    return raw[: key.start()] + b'"prompt_token_ids":null' + raw[end + 1 :]


# orjson reads an integer past 64 bits as a float; Python's json, exactly. No float's digits
# (17 significant at most), token id or timestamp comes near 19 digits in a row. Found with
# C-speed bytes methods (a regex takes longer than orjson's whole parse).
_DIGITS_AS_ZERO = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_DIGITS = b"0" * 19


def _has_long_digits(data: bytes) -> bool:
    return _LONG_DIGITS in data.translate(_DIGITS_AS_ZERO)


def answer_json(raw: bytes, what: str) -> Any:
    data = without_prompt_echo(raw)
    if not _has_long_digits(data):
        try:
            # orjson reads strict JSON, into the same values, three times as fast (each streamed
            # token is a line; a prompt_logprobs answer is megabytes, read on the event loop).
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass  # not strict JSON (NaN, UTF-16, lone surrogates...): Python's reader decides
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise malformed_answer(f"{what} that is not JSON", raw) from None
