"""Gemini requests (generateContent, countTokens): validation and translation of contents, parts,
tools and generation config to the canonical chat form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rewriter import jsonbody
from rewriter.canonical import (
    ChatRequest,
    Message,
    RequestError,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from rewriter.providers.gemini.fields import (
    get_field,
    integer_at,
    list_at,
    number_at,
    object_at,
)
from rewriter.providers.gemini.routes import PART_SEPARATOR
from rewriter.providers.gemini.schemas import lower_case_types, openapi_to_json_schema

# -- request ---------------------------------------------------------------------------------


@dataclass
class GeminiRequest:
    """A parsed ``generateContent`` call: the canonical chat plus what only its answer needs."""

    chat: ChatRequest
    # generationConfig.thinkingConfig.includeThoughts: answer reasoning as `thought` parts.
    include_thoughts: bool = False


_UNSUPPORTED_PARTS = {
    "inlineData": "inline data (images, audio, files)",
    "fileData": "file data",
    "executableCode": "executable code",
    "codeExecutionResult": "code execution results",
    "videoMetadata": "video metadata",
}


def _part_kind(part: dict[str, Any], where: str) -> str:
    for kind in ("text", "functionCall", "functionResponse", *_UNSUPPORTED_PARTS):
        if get_field(part, kind) is not None:
            if kind in _UNSUPPORTED_PARTS:
                raise RequestError(
                    f"{where}: {_UNSUPPORTED_PARTS[kind]} is not supported: the policy served "
                    "by this proxy reads text only. Send the content as text instead.",
                    param=where,
                )
            return kind
    if get_field(part, "thoughtSignature") is not None or part.get("thought"):
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
        part = object_at(raw, f"{where}.parts[{j}]")
        kind = _part_kind(part, f"{where}.parts[{j}]")
        if kind == "text":
            (thoughts if part.get("thought") else texts).append(str(part["text"]))
        elif kind == "functionCall":
            call = object_at(get_field(part, "functionCall"), f"{where}.parts[{j}].function_call")
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
        part = object_at(raw, f"{where}.parts[{j}]")
        kind = _part_kind(part, f"{where}.parts[{j}]")
        if kind == "text":
            texts.append(str(part["text"]))
        elif kind == "functionResponse":
            flush()
            response = object_at(
                get_field(part, "functionResponse"), f"{where}.parts[{j}].function_response"
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
        content = object_at(raw, where)
        role = content.get("role") or "user"
        parts = list_at(content.get("parts"), f"{where}.parts")
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
    content = object_at(system, "system_instruction")
    texts = []
    for j, raw in enumerate(list_at(content.get("parts"), "system_instruction.parts")):
        part = object_at(raw, f"system_instruction.parts[{j}]")
        if _part_kind(part, f"system_instruction.parts[{j}]") != "text":
            raise RequestError(
                f"system_instruction.parts[{j}]: only text parts are allowed in a system "
                "instruction.",
                param=f"system_instruction.parts[{j}]",
            )
        texts.append(str(part["text"]))
    return PART_SEPARATOR.join(texts)


# OpenAPI 3.0 schema (Gemini's `Schema`) keywords that mean the same in JSON Schema.


def _tools(tools: list[Any]) -> list[ToolSpec]:
    out: list[ToolSpec] = []
    for i, raw in enumerate(tools):
        tool = object_at(raw, f"tools[{i}]")
        declarations = get_field(tool, "functionDeclarations")
        # googleSearch, codeExecution, urlContext, ...: run at Google, nothing here can run
        # them, so the policy is not offered them.
        for k, raw_decl in enumerate(list_at(declarations, f"tools[{i}].function_declarations")):
            where = f"tools[{i}].function_declarations[{k}]"
            decl = object_at(raw_decl, where)
            name = decl.get("name")
            if not isinstance(name, str) or not name:
                raise RequestError(
                    f"{where}.name: a function declaration needs a name.", param=f"{where}.name"
                )
            json_schema = get_field(decl, "parametersJsonSchema")
            if json_schema is not None:
                parameters = lower_case_types(
                    object_at(json_schema, f"{where}.parameters_json_schema")
                )
            elif decl.get("parameters") is not None:
                parameters = openapi_to_json_schema(decl["parameters"], f"{where}.parameters")
            else:
                parameters = {}
            out.append(ToolSpec(name, str(decl.get("description") or ""), parameters))
    return out


def _tool_choice(tool_config: dict[str, Any]) -> str | dict[str, Any] | None:
    config = object_at(
        get_field(tool_config, "functionCallingConfig"), "tool_config.function_calling_config"
    )
    if not config:
        return None
    mode = str(config.get("mode") or "AUTO").upper()
    allowed = list_at(get_field(config, "allowedFunctionNames"), "allowed_function_names")
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
    mime = get_field(config, "responseMimeType") or "text/plain"
    json_schema = get_field(config, "responseJsonSchema")
    if json_schema is None:
        json_schema = config.get("_responseJsonSchema")  # the JS SDK's spelling of it
    schema = get_field(config, "responseSchema")
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
            object_at(json_schema, "generation_config.response_json_schema")
        )
        return schema_object
    if schema is not None:
        return openapi_to_json_schema(schema, "generation_config.response_schema")
    return {"type": "object"}


def _enable_thinking(thinking: dict[str, Any]) -> bool | None:
    """thinkingConfig -> the template's thinking switch; None (no config): its default."""
    if not thinking:
        return None
    budget = get_field(thinking, "thinkingBudget")
    if budget is not None:
        return bool(budget)  # 0: off; -1 (dynamic) or a budget: on
    level = get_field(thinking, "thinkingLevel")
    if level is not None:
        return str(level).upper() not in ("MINIMAL", "THINKING_LEVEL_UNSPECIFIED")
    if get_field(thinking, "includeThoughts"):
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


def model_name(name: str) -> str:
    return name.removeprefix("models/")


def _from_generate_request(
    raw: dict[str, Any], model: str, *, stream: bool, count_tokens: bool
) -> GeminiRequest:
    contents = list_at(raw.get("contents"), "contents")
    if not contents and not count_tokens:
        raise RequestError("* GenerateContentRequest.contents: contents is not specified")
    messages: list[Message] = []
    system = _system_text(get_field(raw, "systemInstruction"))
    if system:
        messages.append(Message(role="system", content=system))
    messages.extend(_messages(contents))

    config = object_at(get_field(raw, "generationConfig"), "generation_config")
    candidates = integer_at(config, "candidateCount", low=1)
    if candidates is not None and candidates > 1:
        raise RequestError(
            f"generation_config.candidate_count: this proxy answers one candidate per call "
            f"(asked for {candidates}); leave candidateCount out or set it to 1.",
            param="generation_config.candidate_count",
        )
    thinking = object_at(get_field(config, "thinkingConfig"), "generation_config.thinking_config")
    schema = _json_schema(config)
    enable_thinking = _enable_thinking(thinking)
    if schema is not None:
        # The schema constrains the completion from its first token: no room for a <think>.
        enable_thinking = False
    stop = list_at(get_field(config, "stopSequences"), "generation_config.stop_sequences")
    top_k = number_at(config, "topK", low=1)
    sampling = SamplingParams(
        max_tokens=integer_at(config, "maxOutputTokens", low=1),
        temperature=number_at(config, "temperature", low=0, high=2),
        top_p=number_at(config, "topP", low=0, high=1),
        top_k=int(top_k) if top_k is not None else None,
        seed=integer_at(config, "seed", low=-(2**31)),
        stop=[str(s) for s in stop],
        json_schema=schema,
    )
    chat = ChatRequest(
        messages=messages,
        model=model_name(model),
        tools=_tools(list_at(raw.get("tools"), "tools")),
        tool_choice=_tool_choice(object_at(get_field(raw, "toolConfig"), "tool_config")),
        sampling=sampling,
        stream=stream,
        include_usage=True,
        enable_thinking=enable_thinking,
    )
    include_thoughts = bool(get_field(thinking, "includeThoughts")) and enable_thinking is not False
    return GeminiRequest(chat, include_thoughts)


def parse_request(body: bytes, model: str, *, stream: bool = False) -> GeminiRequest:
    """A ``generateContent`` / ``streamGenerateContent`` body; ``model`` comes from the URL."""
    return _from_generate_request(_load(body), model, stream=stream, count_tokens=False)


def parse_count_tokens(body: bytes, model: str) -> ChatRequest:
    """A ``countTokens`` body: ``{contents}`` or ``{generateContentRequest: {...}}``."""
    raw = _load(body)
    inner = get_field(raw, "generateContentRequest")
    if inner is not None:
        inner = object_at(inner, "generate_content_request")
        return _from_generate_request(
            inner, str(inner.get("model") or model), stream=False, count_tokens=True
        ).chat
    return _from_generate_request(raw, model, stream=False, count_tokens=True).chat
