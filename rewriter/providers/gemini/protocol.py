"""The Gemini API (``generativelanguage.googleapis.com``) <-> the canonical chat form.

Gemini names the model and the method in the URL (``/v1beta/models/{model}:generateContent``,
``:streamGenerateContent?alt=sse``, ``:countTokens``), so :func:`parse_route` reads the path and
:func:`parse_request` takes the model and streaming flag from it. Requests carry ``contents``
(roles ``user`` / ``model``) made of parts: ``text`` (``thought: true`` for reasoning),
``functionCall``, ``functionResponse``. Clients echo model turns back with a
``thoughtSignature`` on parts; it is opaque and never reaches the policy, so a call with or
without it is the same conversation. Responses are ``GenerateContentResponse`` objects, whole or
one per SSE ``data:`` line as tokens arrive (function calls whole). Errors use Google's shape
``{"error": {"code", "message", "status"}}``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from rewriter import jsonbody, wire
from rewriter.canonical import (
    AssistantReply,
    ChatRequest,
    Message,
    RequestError,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from rewriter.parsers import ContentDelta, ParseEvent, ReasoningDelta, ToolCallEvent

API_VERSIONS = ("v1beta", "v1", "v1alpha")
GENERATION_METHODS = ["generateContent", "streamGenerateContent", "countTokens"]
# Gemini joins the text parts of one turn as they are: a streamed reply comes back to the server
# as many text parts whose concatenation is the reply.
PART_SEPARATOR = ""

# -- routes ----------------------------------------------------------------------------------

RouteKind = Literal["generate", "stream", "count_tokens", "list_models", "get_model", "other"]

_ROUTE_RE = re.compile(r"^/(v1beta|v1|v1alpha)/models(?:/([^/:]+))?(?::([A-Za-z]+))?/?$")
_KINDS: dict[str, RouteKind] = {
    "generateContent": "generate",
    "streamGenerateContent": "stream",
    "countTokens": "count_tokens",
}


@dataclass(frozen=True)
class Route:
    """What a Gemini API path asks for. ``method`` is the text after ``:`` (``other`` kinds:
    ``embedContent``, ``batchGenerateContent``, ... which this proxy does not serve)."""

    kind: RouteKind
    api_version: str
    model: str = ""
    method: str = ""


def parse_route(http_method: str, path: str) -> Route | None:
    """The Gemini route of ``path`` (already percent-decoded), or None if it is not one."""
    match = _ROUTE_RE.match(path)
    if match is None:
        return None
    version, model, method = match.group(1), match.group(2) or "", match.group(3) or ""
    if not model:
        if method:
            return None
        return Route("list_models" if http_method == "GET" else "other", version)
    if not method:
        return Route("get_model" if http_method == "GET" else "other", version, model)
    kind = _KINDS.get(method, "other") if http_method == "POST" else "other"
    return Route(kind, version, model, method)


# -- request ---------------------------------------------------------------------------------


@dataclass
class GeminiRequest:
    """A parsed ``generateContent`` call: the canonical chat plus what only its answer needs."""

    chat: ChatRequest
    # generationConfig.thinkingConfig.includeThoughts: answer reasoning as `thought` parts.
    include_thoughts: bool = False


def _snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def _get(obj: dict[str, Any], name: str) -> Any:
    """A field by its JSON (lowerCamel) name or its proto (snake_case) name: Google's JSON
    parser accepts both, and clients use both."""
    if name in obj:
        return obj[name]
    return obj.get(_snake(name))


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(
            f"Invalid JSON payload received. {where}: expected an object, got "
            f"{type(value).__name__}.",
            param=where,
        )
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(
            f"Invalid JSON payload received. {where}: expected a list, got {type(value).__name__}.",
            param=where,
        )
    return value


def _number(
    config: dict[str, Any], name: str, *, low: float | None = None, high: float | None = None
) -> float | None:
    value = _get(config, name)
    if value is None:
        return None
    where = f"generation_config.{_snake(name)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{where}: expected a number, got {value!r:.60}.", param=where)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"{where}: {value} is out of range {bounds}.", param=where)
    return float(value)


def _integer(config: dict[str, Any], name: str, *, low: int) -> int | None:
    value = _get(config, name)
    if value is None:
        return None
    where = f"generation_config.{_snake(name)}"
    if isinstance(value, bool) or not isinstance(value, int):
        # Proto JSON allows int64 as a string (ASCII digits only; int() takes others too).
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,19}", value):
            value = int(value)
        else:
            raise RequestError(f"{where}: expected an integer, got {value!r:.60}.", param=where)
    if not jsonbody.INT_MIN <= value <= jsonbody.INT_MAX:
        raise RequestError(f"{where}: {value} is out of the int64 range.", param=where)
    if value < low:
        raise RequestError(f"{where}: must be at least {low} (got {value}).", param=where)
    return int(value)


_UNSUPPORTED_PARTS = {
    "inlineData": "inline data (images, audio, files)",
    "fileData": "file data",
    "executableCode": "executable code",
    "codeExecutionResult": "code execution results",
    "videoMetadata": "video metadata",
}


def _part_kind(part: dict[str, Any], where: str) -> str:
    for kind in ("text", "functionCall", "functionResponse", *_UNSUPPORTED_PARTS):
        if _get(part, kind) is not None:
            if kind in _UNSUPPORTED_PARTS:
                raise RequestError(
                    f"{where}: {_UNSUPPORTED_PARTS[kind]} is not supported: the policy served "
                    "by this proxy reads text only. Send the content as text instead.",
                    param=where,
                )
            return kind
    if _get(part, "thoughtSignature") is not None or part.get("thought"):
        return "signature"  # a part holding only a signature: nothing for the policy
    raise RequestError(
        f"{where}: a part must hold one of text, functionCall or functionResponse "
        f"(got keys {sorted(part)}).",
        param=where,
    )


def call_id(content_index: int, part_index: int) -> str:
    """The id of a function call the client sent without one: stable, because a conversation
    is sent again and again with the call at the same place."""
    return f"call_gemini_{content_index}_{part_index}"


def _function_response_text(response: Any) -> str:
    # Gemini CLI and the SDKs answer {"output": "..."} or {"error": "..."}; the policy should
    # read that text, not a JSON wrapper around it.
    if isinstance(response, dict) and len(response) == 1:
        ((key, value),) = response.items()
        if isinstance(value, str):
            if key in ("output", "result", "content"):
                return value
            if key == "error":
                return "Error: " + value
    if isinstance(response, str):
        return response
    return json.dumps(response, ensure_ascii=False)


def _model_message(parts: list[Any], index: int, where: str) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, raw in enumerate(parts):
        part = _object(raw, f"{where}.parts[{j}]")
        kind = _part_kind(part, f"{where}.parts[{j}]")
        if kind == "text":
            (thoughts if part.get("thought") else texts).append(str(part["text"]))
        elif kind == "functionCall":
            call = _object(_get(part, "functionCall"), f"{where}.parts[{j}].function_call")
            name = call.get("name")
            if not isinstance(name, str) or not name:
                raise RequestError(
                    f"{where}.parts[{j}].function_call.name: a function call needs a name.",
                    param=f"{where}.parts[{j}].function_call.name",
                )
            calls.append(
                ToolCall(
                    id=str(call.get("id") or call_id(index, j)),
                    name=name,
                    arguments=json.dumps(call.get("args") or {}, ensure_ascii=False),
                )
            )
        elif kind == "functionResponse":
            raise RequestError(
                f"{where}.parts[{j}]: a functionResponse belongs in a 'user' turn, not a "
                "'model' turn.",
                param=f"{where}.parts[{j}]",
            )
    return Message(
        role="assistant",
        content=PART_SEPARATOR.join(texts),
        reasoning=PART_SEPARATOR.join(thoughts) or None,
        tool_calls=tuple(calls),
    )


def _user_messages(parts: list[Any], where: str, pending: list[ToolCall]) -> list[Message]:
    """One user turn -> canonical tool results and user text, in order. ``pending``: the calls
    of the model turn before it not yet answered (to give id-less responses their call's id)."""
    out: list[Message] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append(Message(role="user", content=PART_SEPARATOR.join(texts)))
            texts.clear()

    for j, raw in enumerate(parts):
        part = _object(raw, f"{where}.parts[{j}]")
        kind = _part_kind(part, f"{where}.parts[{j}]")
        if kind == "text":
            texts.append(str(part["text"]))
        elif kind == "functionResponse":
            flush()
            response = _object(
                _get(part, "functionResponse"), f"{where}.parts[{j}].function_response"
            )
            name = str(response.get("name") or "")
            given = response.get("id")
            match = next((c for c in pending if (c.id == given if given else c.name == name)), None)
            if match is not None:
                pending.remove(match)
            tool_call_id = str(given or (match.id if match else f"call_gemini_{name}"))
            out.append(
                Message(
                    role="tool",
                    content=_function_response_text(response.get("response")),
                    tool_call_id=tool_call_id,
                    name=name or None,
                )
            )
        elif kind == "functionCall":
            raise RequestError(
                f"{where}.parts[{j}]: a functionCall belongs in a 'model' turn, not a 'user' turn.",
                param=f"{where}.parts[{j}]",
            )
    flush()
    return out


def _messages(contents: list[Any]) -> list[Message]:
    messages: list[Message] = []
    pending: list[ToolCall] = []
    for i, raw in enumerate(contents):
        where = f"contents[{i}]"
        content = _object(raw, where)
        role = content.get("role") or "user"
        parts = _list(content.get("parts"), f"{where}.parts")
        if role == "model":
            message = _model_message(parts, i, where)
            pending = list(message.tool_calls)
            messages.append(message)
        elif role in ("user", "function"):  # "function": the older spelling of tool results
            messages.extend(_user_messages(parts, where, pending))
        else:
            raise RequestError(
                f"Please use a valid role: user, model. ({where}.role is {role!r})",
                param=f"{where}.role",
            )
    return messages


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    content = _object(system, "system_instruction")
    texts = []
    for j, raw in enumerate(_list(content.get("parts"), "system_instruction.parts")):
        part = _object(raw, f"system_instruction.parts[{j}]")
        if _part_kind(part, f"system_instruction.parts[{j}]") != "text":
            raise RequestError(
                f"system_instruction.parts[{j}]: only text parts are allowed in a system "
                "instruction.",
                param=f"system_instruction.parts[{j}]",
            )
        texts.append(str(part["text"]))
    return PART_SEPARATOR.join(texts)


# OpenAPI 3.0 schema (Gemini's `Schema`) keywords that mean the same in JSON Schema.
_SCHEMA_KEYWORDS = (
    "format",
    "title",
    "description",
    "enum",
    "default",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
)
_INT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def openapi_to_json_schema(schema: Any, where: str = "schema") -> dict[str, Any]:
    """Gemini's ``Schema`` (OpenAPI 3.0 subset, upper-case ``type``, ``nullable``,
    ``propertyOrdering``) as the JSON Schema vLLM's structured outputs and chat templates take.
    Lower-case types (clients often send them) are accepted as well."""
    node = _object(schema, where)
    out: dict[str, Any] = {}
    kind = node.get("type")
    if isinstance(kind, str) and kind.upper() != "TYPE_UNSPECIFIED":
        out["type"] = kind.lower()
    elif kind is not None and not isinstance(kind, str):
        raise RequestError(f"{where}.type: expected a type name, got {kind!r}.", param=where)
    for key in _SCHEMA_KEYWORDS:
        value = _get(node, key)
        if value is None:
            continue
        if key in _INT_KEYWORDS and isinstance(value, str) and value.isdigit():
            value = int(value)  # int64 fields arrive as strings in proto JSON
        out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    properties = node.get("properties")
    if properties is not None:
        out["properties"] = {
            name: openapi_to_json_schema(sub, f"{where}.properties.{name}")
            for name, sub in _object(properties, f"{where}.properties").items()
        }
    if node.get("items") is not None:
        out["items"] = openapi_to_json_schema(node["items"], f"{where}.items")
    any_of = _get(node, "anyOf")
    if any_of is not None:
        out["anyOf"] = [
            openapi_to_json_schema(sub, f"{where}.any_of[{k}]")
            for k, sub in enumerate(_list(any_of, f"{where}.any_of"))
        ]
    if node.get("nullable") is True:
        if "type" in out:
            out["type"] = [out["type"], "null"]
        elif "anyOf" in out:
            out["anyOf"].append({"type": "null"})
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


_GEMINI_TYPES = frozenset(("STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY", "OBJECT", "NULL"))


def lower_case_types(schema: Any) -> Any:
    """A JSON schema with Gemini's upper-case type names (``"OBJECT"``) lower-cased.

    Gemini accepts them in ``responseJsonSchema`` and ``parametersJsonSchema``, and Gemini CLI's
    router sends them there; JSON Schema (and so vLLM's structured outputs) knows only the
    lower-case names. Anything else is left exactly as it is."""
    if isinstance(schema, list):
        return [lower_case_types(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str) and value in _GEMINI_TYPES:
            out[key] = value.lower()
        elif key == "type" and isinstance(value, list):
            out[key] = [v.lower() if v in _GEMINI_TYPES else v for v in value]
        else:
            out[key] = lower_case_types(value)
    return out


def _tools(tools: list[Any]) -> list[ToolSpec]:
    out: list[ToolSpec] = []
    for i, raw in enumerate(tools):
        tool = _object(raw, f"tools[{i}]")
        declarations = _get(tool, "functionDeclarations")
        # googleSearch, codeExecution, urlContext, ...: run at Google, nothing here can run
        # them, so the policy is not offered them.
        for k, raw_decl in enumerate(_list(declarations, f"tools[{i}].function_declarations")):
            where = f"tools[{i}].function_declarations[{k}]"
            decl = _object(raw_decl, where)
            name = decl.get("name")
            if not isinstance(name, str) or not name:
                raise RequestError(
                    f"{where}.name: a function declaration needs a name.", param=f"{where}.name"
                )
            json_schema = _get(decl, "parametersJsonSchema")
            if json_schema is not None:
                parameters = lower_case_types(
                    _object(json_schema, f"{where}.parameters_json_schema")
                )
            elif decl.get("parameters") is not None:
                parameters = openapi_to_json_schema(decl["parameters"], f"{where}.parameters")
            else:
                parameters = {}
            out.append(ToolSpec(name, str(decl.get("description") or ""), parameters))
    return out


def _tool_choice(tool_config: dict[str, Any]) -> str | dict[str, Any] | None:
    config = _object(
        _get(tool_config, "functionCallingConfig"), "tool_config.function_calling_config"
    )
    if not config:
        return None
    mode = str(config.get("mode") or "AUTO").upper()
    allowed = _list(_get(config, "allowedFunctionNames"), "allowed_function_names")
    if mode in ("AUTO", "MODE_UNSPECIFIED", "VALIDATED"):
        return "auto"
    if mode == "NONE":
        return "none"
    if mode == "ANY":
        if len(allowed) == 1:
            return {"type": "function", "function": {"name": str(allowed[0])}}
        return "required"
    raise RequestError(
        f"tool_config.function_calling_config.mode: {mode!r} is not one of AUTO, ANY, NONE, "
        "VALIDATED.",
        param="tool_config.function_calling_config.mode",
    )


def _json_schema(config: dict[str, Any]) -> dict[str, Any] | None:
    mime = _get(config, "responseMimeType") or "text/plain"
    json_schema = _get(config, "responseJsonSchema")
    if json_schema is None:
        json_schema = config.get("_responseJsonSchema")  # the JS SDK's spelling of it
    schema = _get(config, "responseSchema")
    if mime == "text/plain":
        if json_schema is not None or schema is not None:
            raise RequestError(
                "generation_config.response_mime_type: a response schema needs "
                "response_mime_type 'application/json'.",
                param="generation_config.response_mime_type",
            )
        return None
    if mime != "application/json":
        raise RequestError(
            f"generation_config.response_mime_type: {mime!r} is not supported by this proxy; "
            "use 'text/plain' or 'application/json'.",
            param="generation_config.response_mime_type",
        )
    if json_schema is not None:
        schema_object: dict[str, Any] = lower_case_types(
            _object(json_schema, "generation_config.response_json_schema")
        )
        return schema_object
    if schema is not None:
        return openapi_to_json_schema(schema, "generation_config.response_schema")
    return {"type": "object"}


def _enable_thinking(thinking: dict[str, Any]) -> bool | None:
    """thinkingConfig -> the template's thinking switch; None (no config): its default."""
    if not thinking:
        return None
    budget = _get(thinking, "thinkingBudget")
    if budget is not None:
        return bool(budget)  # 0: off; -1 (dynamic) or a budget: on
    level = _get(thinking, "thinkingLevel")
    if level is not None:
        return str(level).upper() not in ("MINIMAL", "THINKING_LEVEL_UNSPECIFIED")
    if _get(thinking, "includeThoughts"):
        return True
    return None


def _load(body: bytes) -> dict[str, Any]:
    try:
        raw = jsonbody.loads(body)
    except jsonbody.JSONBodyError as exc:
        raise RequestError(f"Invalid JSON payload received. {exc}.") from None
    if not isinstance(raw, dict):
        raise RequestError("Invalid JSON payload received. The body must be a JSON object.")
    return raw


def _model_name(name: str) -> str:
    return name.removeprefix("models/")


def _from_generate_request(
    raw: dict[str, Any], model: str, *, stream: bool, count_tokens: bool
) -> GeminiRequest:
    contents = _list(raw.get("contents"), "contents")
    if not contents and not count_tokens:
        raise RequestError("* GenerateContentRequest.contents: contents is not specified")
    messages: list[Message] = []
    system = _system_text(_get(raw, "systemInstruction"))
    if system:
        messages.append(Message(role="system", content=system))
    messages.extend(_messages(contents))

    config = _object(_get(raw, "generationConfig"), "generation_config")
    candidates = _integer(config, "candidateCount", low=1)
    if candidates is not None and candidates > 1:
        raise RequestError(
            f"generation_config.candidate_count: this proxy answers one candidate per call "
            f"(asked for {candidates}); leave candidateCount out or set it to 1.",
            param="generation_config.candidate_count",
        )
    thinking = _object(_get(config, "thinkingConfig"), "generation_config.thinking_config")
    schema = _json_schema(config)
    enable_thinking = _enable_thinking(thinking)
    if schema is not None:
        # The schema constrains the completion from its first token: no room for a <think>.
        enable_thinking = False
    stop = _list(_get(config, "stopSequences"), "generation_config.stop_sequences")
    top_k = _number(config, "topK", low=1)
    sampling = SamplingParams(
        max_tokens=_integer(config, "maxOutputTokens", low=1),
        temperature=_number(config, "temperature", low=0, high=2),
        top_p=_number(config, "topP", low=0, high=1),
        top_k=int(top_k) if top_k is not None else None,
        seed=_integer(config, "seed", low=-(2**31)),
        stop=[str(s) for s in stop],
        json_schema=schema,
    )
    chat = ChatRequest(
        messages=messages,
        model=_model_name(model),
        tools=_tools(_list(raw.get("tools"), "tools")),
        tool_choice=_tool_choice(_object(_get(raw, "toolConfig"), "tool_config")),
        sampling=sampling,
        stream=stream,
        include_usage=True,
        enable_thinking=enable_thinking,
    )
    include_thoughts = bool(_get(thinking, "includeThoughts")) and enable_thinking is not False
    return GeminiRequest(chat, include_thoughts)


def parse_request(body: bytes, model: str, *, stream: bool = False) -> GeminiRequest:
    """A ``generateContent`` / ``streamGenerateContent`` body; ``model`` comes from the URL."""
    return _from_generate_request(_load(body), model, stream=stream, count_tokens=False)


def parse_count_tokens(body: bytes, model: str) -> ChatRequest:
    """A ``countTokens`` body: ``{contents}`` or ``{generateContentRequest: {...}}``."""
    raw = _load(body)
    inner = _get(raw, "generateContentRequest")
    if inner is not None:
        inner = _object(inner, "generate_content_request")
        return _from_generate_request(
            inner, str(inner.get("model") or model), stream=False, count_tokens=True
        ).chat
    return _from_generate_request(raw, model, stream=False, count_tokens=True).chat


# -- response --------------------------------------------------------------------------------

_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def status_name(code: int) -> str:
    return _STATUS_NAMES.get(code, "INTERNAL" if code >= 500 else "INVALID_ARGUMENT")


def error_body(code: int, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status_name(code)}}


def prompt_too_long_message(prompt_tokens: int, max_tokens: int) -> str:
    # Google's own wording for an over-long input.
    return (
        f"The input token count ({prompt_tokens}) exceeds the maximum number of tokens allowed "
        f"({max_tokens})."
    )


def new_response_id() -> str:
    return secrets.token_urlsafe(16)


def finish_reason(vllm_reason: str | None) -> str:
    """Gemini's ``finishReason``: function calls and stop sequences end with STOP too."""
    return "MAX_TOKENS" if vllm_reason == "length" else "STOP"


def function_args(call: ToolCall) -> dict[str, Any]:
    value = call.arguments_object()
    # Gemini's `args` is always an object.
    return value if isinstance(value, dict) else {"input": value}


def function_call_part(call: ToolCall) -> dict[str, Any]:
    # The id lets a client answer with it, so the trajectory matches results to calls exactly.
    return {"functionCall": {"id": call.id, "name": call.name, "args": function_args(call)}}


def usage_metadata(
    prompt_tokens: int, output_tokens: int, thoughts_tokens: int = 0
) -> dict[str, Any]:
    """``candidatesTokenCount`` excludes thoughts; ``totalTokenCount`` counts everything."""
    out: dict[str, Any] = {
        "promptTokenCount": prompt_tokens,
        "candidatesTokenCount": output_tokens - thoughts_tokens,
        "totalTokenCount": prompt_tokens + output_tokens,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt_tokens}],
    }
    if thoughts_tokens:
        out["thoughtsTokenCount"] = thoughts_tokens
    return out


def response_parts(reply: AssistantReply, include_thoughts: bool) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    reasoning = (reply.reasoning or "").strip()
    if include_thoughts and reasoning:
        parts.append({"text": reasoning, "thought": True})
    text = reply.content.strip()
    if text:
        parts.append({"text": text})
    parts.extend(function_call_part(c) for c in reply.tool_calls)
    if not parts:
        parts.append({"text": ""})
    return parts


def _response(
    response_id: str,
    model: str,
    parts: list[dict[str, Any]] | None,
    reason: str | None,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    candidate: dict[str, Any] = {"index": 0}
    if parts is not None:
        candidate["content"] = {"parts": parts, "role": "model"}
    if reason is not None:
        candidate["finishReason"] = reason
    out: dict[str, Any] = {"candidates": [candidate]}
    if usage is not None:
        out["usageMetadata"] = usage
    out["modelVersion"] = model
    out["responseId"] = response_id
    return out


def generate_response(
    response_id: str,
    model: str,
    reply: AssistantReply,
    reason: str,
    prompt_tokens: int,
    output_tokens: int,
    *,
    include_thoughts: bool = False,
    thoughts_tokens: int = 0,
) -> dict[str, Any]:
    return _response(
        response_id,
        model,
        response_parts(reply, include_thoughts),
        reason,
        usage_metadata(prompt_tokens, output_tokens, thoughts_tokens),
    )


def sse(chunk: dict[str, Any]) -> bytes:
    # The line ending Google's servers use; every SDK splits on it.
    return wire.sse(chunk, terminator=b"\r\n\r\n")


class ChunkWriter:
    """The ``GenerateContentResponse`` chunks of one ``streamGenerateContent`` answer.

    Text goes out as it arrives; whitespace at the edges of the reply's text is held back (as
    the whole answer strips it), so ``"\\n\\n<tool_call>..."`` streams as a function call alone.
    Thoughts are sent only when the request asked for them (``includeThoughts``).
    """

    def __init__(
        self, response_id: str, model: str, prompt_tokens: int, include_thoughts: bool = False
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.include_thoughts = include_thoughts
        self.sent_parts = 0
        self._held: dict[str, str] = {"text": "", "thought": ""}
        self._started: dict[str, bool] = {"text": False, "thought": False}

    def _chunk(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        self.sent_parts += len(parts)
        usage = {"promptTokenCount": self.prompt_tokens, "totalTokenCount": self.prompt_tokens}
        return _response(self.response_id, self.model, parts, None, usage)

    def _text(self, kind: str, text: str) -> dict[str, Any] | None:
        if not self._started[kind]:
            text = text.lstrip()
            if not text:
                return None
            self._started[kind] = True
        text = self._held[kind] + text
        body = text.rstrip()
        self._held[kind] = text[len(body) :]
        if not body:
            return None
        part: dict[str, Any] = {"text": body}
        if kind == "thought":
            part["thought"] = True
        return part

    def chunks(self, events: list[ParseEvent]) -> list[dict[str, Any]]:
        """The chunks for these parser events: one per event that has something to send."""
        out: list[dict[str, Any]] = []
        for event in events:
            part: dict[str, Any] | None = None
            if isinstance(event, ContentDelta):
                part = self._text("text", event.text)
            elif isinstance(event, ReasoningDelta):
                if self.include_thoughts:
                    part = self._text("thought", event.text)
            elif isinstance(event, ToolCallEvent):
                part = function_call_part(event.call)
            if part is not None:
                out.append(self._chunk([part]))
        return out

    def finish(self, reason: str, output_tokens: int, thoughts_tokens: int = 0) -> dict[str, Any]:
        """The last chunk: the finish reason and the usage (an empty text part if nothing at
        all was sent, as Gemini answers an empty reply)."""
        parts = [] if self.sent_parts else [{"text": ""}]
        self.sent_parts += len(parts)
        usage = usage_metadata(self.prompt_tokens, output_tokens, thoughts_tokens)
        return _response(self.response_id, self.model, parts or None, reason, usage)

    def error(self, code: int, message: str) -> dict[str, Any]:
        return error_body(code, message)


def count_tokens_response(total_tokens: int) -> dict[str, Any]:
    return {
        "totalTokens": total_tokens,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": total_tokens}],
    }


def model_object(
    name: str, input_token_limit: int | None = None, output_token_limit: int | None = None
) -> dict[str, Any]:
    name = _model_name(name)
    out: dict[str, Any] = {
        "name": f"models/{name}",
        "baseModelId": name,
        "version": "agenttap",
        "displayName": name,
        "description": f"{name}, answered by the agenttap policy",
        "supportedGenerationMethods": list(GENERATION_METHODS),
        "thinking": True,
    }
    if input_token_limit:
        out["inputTokenLimit"] = input_token_limit
        out["outputTokenLimit"] = output_token_limit or input_token_limit
    return out


def models_list(
    names: list[str], input_token_limit: int | None = None, output_token_limit: int | None = None
) -> dict[str, Any]:
    return {"models": [model_object(n, input_token_limit, output_token_limit) for n in names]}
