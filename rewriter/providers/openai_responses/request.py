"""OpenAI Responses requests: the wire schema and their translation to the canonical chat form
(input items, function and custom tools, namespaces, the reasoning round trip).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from rewriter.canonical import (
    ChatRequest,
    Message,
    RequestError,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from rewriter.providers.openai_chat.request import load_json_object
from rewriter.providers.openai_responses.ids import origin_response
from rewriter.shapes import expect_object, text_or_none
from rewriter.wire import Lenient

logger = logging.getLogger(__name__)

# Tools the provider runs itself on OpenAI's side: a policy cannot call them, so they are left out.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "mcp",
        "local_shell",
    }
)
ENCRYPTED_PREFIX = "agenttap-reasoning-v1:"
INCLUDE_ENCRYPTED = "reasoning.encrypted_content"


class ResponsesRequestIn(Lenient):
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    generate: bool | None = None


@dataclass(frozen=True)
class Context:
    """What a later call with ``previous_response_id`` continues: the conversation without
    instructions, and the tools that arrived as input items (top-level tools are not carried)."""

    messages: tuple[Message, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    custom_tools: frozenset[str] = frozenset()
    namespaces: tuple[tuple[str, tuple[str, str]], ...] = ()

    def extended(self, reply: Message) -> Context:
        return Context((*self.messages, reply), self.tools, self.custom_tools, self.namespaces)


@dataclass
class ResponsesRequest:
    """A parsed request: the canonical chat plus what the answer must echo or decide."""

    chat: ChatRequest
    # What a later previous_response_id continues (add the reply with Context.extended).
    context: Context
    # Names of the custom (freeform) tools: their calls are answered as custom_tool_call.
    custom_tools: frozenset[str]
    include_encrypted: bool
    store: bool
    previous_response_id: str | None
    # Request fields a response object repeats back.
    echo: dict[str, Any] = field(default_factory=dict)
    # Qualified tool name ("collaboration.spawn_agent") -> (namespace, name) for answers.
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    # False: a warm-up (Codex's WebSocket prewarm); answered without calling the policy.
    generate: bool = True


# -- request ---------------------------------------------------------------------------------


def encrypt_reasoning(text: str) -> str:
    """The ``encrypted_content`` this proxy gives a reasoning item (opaque to the client)."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def decrypt_reasoning(token: str) -> str | None:
    """The reasoning text of one of this proxy's tokens; None for anyone else's."""
    if not token.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(token[len(ENCRYPTED_PREFIX) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _parts_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            f"Invalid type for '{where}': expected a string or an array.", param=where
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(str(part.get("text") or ""))
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        else:
            raise RequestError(
                f"Content part type {kind!r} at '{where}[{j}]' is not supported by this proxy: "
                "its policy reads text only (input_text / output_text).",
                param=f"{where}[{j}].type",
            )
    return "".join(texts)


def custom_tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A custom tool as a one-string-parameter function schema the template can render."""
    fmt = tool.get("format") or {}
    about = "The tool's whole input, as free text."
    if fmt.get("type") == "grammar":
        about = (
            f"The tool's whole input, as free text in this {fmt.get('syntax', '')} grammar:\n"
            f"{fmt.get('definition', '')}"
        )
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": about}},
        "required": ["input"],
    }


# Tools of the default namespace keep their own name; others are offered as "namespace.name".
DEFAULT_NAMESPACE = "functions"


def qualified_name(name: str, namespace: str | None) -> str:
    return name if not namespace or namespace == DEFAULT_NAMESPACE else f"{namespace}.{name}"


def _tools(
    raw: list[dict[str, Any]],
    where: str,
    namespace: str | None = None,
    namespaced: dict[str, tuple[str, str]] | None = None,
) -> tuple[list[ToolSpec], set[str]]:
    """Tool specs -> canonical; ``namespaced`` collects qualified name -> (namespace, name)."""
    if namespaced is None:
        namespaced = {}
    specs: list[ToolSpec] = []
    custom: set[str] = set()
    for i, tool in enumerate(raw):
        kind = text_or_none(tool.get("type")) if isinstance(tool, dict) else None
        name = text_or_none(tool.get("name")) if isinstance(tool, dict) else None
        if kind in HOSTED_TOOL_TYPES:
            logger.info(
                "%s[%d]: hosted tool %r left out: the policy cannot call it", where, i, kind
            )
            continue
        if kind == "namespace" and isinstance(name, str) and isinstance(tool.get("tools"), list):
            # Codex groups its tools in namespaces; the template sees them flat.
            more, more_custom = _tools(tool["tools"], f"{where}[{i}].tools", name, namespaced)
            specs += more
            custom |= more_custom
            continue
        if kind not in ("function", "custom") or not isinstance(name, str) or not name:
            raise RequestError(
                f"Invalid tool at '{where}[{i}]': this proxy accepts tools of type 'function' "
                f"(name, parameters), 'custom' (name, format) and 'namespace' (name, tools); got "
                f"type {kind!r}.",
                param=f"{where}[{i}]",
            )
        qualified = qualified_name(name, namespace)
        if qualified != name and namespace:
            namespaced[qualified] = (namespace, name)
        name = qualified
        if kind == "function":
            specs.append(
                ToolSpec(name, str(tool.get("description") or ""), tool.get("parameters") or {})
            )
        else:
            custom.add(name)
            specs.append(
                ToolSpec(name, str(tool.get("description") or ""), custom_tool_parameters(tool))
            )
    return specs, custom


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") in ("function", "custom") and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    return "auto"


class _Assistant:
    """The output items of one model turn, gathered into one canonical assistant message."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.origins: list[str] = []  # responses of this proxy's whose items these are
        self.open = False

    def take(self, item: dict[str, Any]) -> None:
        self.open = True
        origin = origin_response(item)
        if origin is not None and origin not in self.origins:
            self.origins.append(origin)

    def message(self) -> Message:
        return Message(
            role="assistant",
            content="".join(self.content),
            reasoning="".join(self.reasoning) if self.reasoning else None,
            tool_calls=tuple(self.calls),
            ids=tuple(self.origins),
        )


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    token = item.get("encrypted_content")
    if isinstance(token, str):
        mine = decrypt_reasoning(token)
        if mine is not None:
            return mine
    if item.get("content"):
        return _parts_text(item["content"], f"{where}.content")
    return _parts_text(item.get("summary") or [], f"{where}.summary")


def parse_input(
    items: str | list[dict[str, Any]],
    where: str = "input",
    namespaced: dict[str, tuple[str, str]] | None = None,
) -> tuple[list[Message], list[ToolSpec], set[str]]:
    """Input items -> canonical messages, plus tools that arrived as items (Codex's
    ``additional_tools``). Fields a client adds to echoed items are ignored."""
    if isinstance(items, str):
        return [Message(role="user", content=items)], [], set()
    messages: list[Message] = []
    tools: list[ToolSpec] = []
    custom: set[str] = set()
    turn = _Assistant()

    def flush() -> None:
        nonlocal turn
        if turn.open:
            messages.append(turn.message())
        turn = _Assistant()

    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"Invalid type for '{at}': expected an object.", param=at)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _parts_text(item.get("content"), f"{at}.content")
            if role == "assistant":
                turn.take(item)
                turn.content.append(text)
                continue
            if role not in ("user", "system", "developer"):
                raise RequestError(
                    f"Invalid value for '{at}.role': {role!r}; expected 'user', 'assistant', "
                    "'system' or 'developer'.",
                    param=f"{at}.role",
                )
            flush()
            messages.append(Message(role="user" if role == "user" else "system", content=text))
        elif kind == "reasoning":
            if turn.open and (turn.content or turn.calls):
                flush()  # reasoning starts a new model turn
            turn.take(item)
            turn.reasoning.append(_reasoning_text(item, at))
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise RequestError(
                    f"Missing 'call_id' or 'name' in '{at}' ({kind}).", param=f"{at}.call_id"
                )
            if kind == "function_call":
                arguments = item.get("arguments")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments or {}, ensure_ascii=False)
            else:
                arguments = json.dumps({"input": str(item.get("input") or "")}, ensure_ascii=False)
            name = qualified_name(name, item.get("namespace"))
            turn.take(item)
            turn.calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"Missing 'call_id' in '{at}' ({kind}).", param=f"{at}.call_id")
            flush()
            output = _parts_text(item.get("output"), f"{at}.output")
            messages.append(Message(role="tool", content=output, tool_call_id=call_id))
        elif kind == "additional_tools":
            more, more_custom = _tools(item.get("tools") or [], f"{at}.tools", None, namespaced)
            tools += more
            custom |= more_custom
        elif kind == "item_reference":
            raise RequestError(
                f"'{at}' is an item_reference: this proxy keeps whole stored responses only; send "
                "previous_response_id or the items themselves.",
                param=f"{at}.type",
            )
        else:
            raise RequestError(
                f"Input item type {kind!r} at '{at}' is not supported by this proxy (it serves "
                "message, reasoning, function_call(_output), custom_tool_call(_output) and "
                "additional_tools).",
                param=f"{at}.type",
            )
    flush()
    return messages, tools, custom


def _format_validation_error(exc: ValidationError) -> RequestError:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    if first["type"] == "missing":
        return RequestError(f"Missing required parameter: '{where}'.", param=where)
    return RequestError(f"Invalid value for '{where}': {first['msg']}.", param=where)


def _json_schema(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = expect_object((text or {}).get("format") or {}, "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise RequestError(
                "Missing required parameter: 'text.format.schema'.", param="text.format.schema"
            )
        return schema
    if kind == "json_object":
        return {"type": "object"}
    return None


def parse_request(
    body: bytes | dict[str, Any],
    history: Callable[[str], Context | None] | None = None,
) -> ResponsesRequest:
    """A ``/v1/responses`` body (or a WebSocket ``response.create`` message) -> canonical.

    ``history(previous_response_id)`` gives the :class:`Context` of a stored response (None when
    unknown)."""
    raw = body if isinstance(body, dict) else load_json_object(body)
    try:
        req = ResponsesRequestIn.model_validate(raw)
    except ValidationError as exc:
        raise _format_validation_error(exc) from None

    earlier = Context()
    if req.previous_response_id:
        found = history(req.previous_response_id) if history else None
        if found is None:
            raise RequestError(
                f"Previous response with id '{req.previous_response_id}' not found. This proxy "
                "keeps responses created with store: true, per session, for a while.",
                param="previous_response_id",
            )
        earlier = found
    item_namespaced: dict[str, tuple[str, str]] = dict(earlier.namespaces)
    new_messages, new_item_tools, new_custom = parse_input(
        req.input or [], "input", item_namespaced
    )
    item_tools = [*earlier.tools, *new_item_tools]
    item_custom = earlier.custom_tools | new_custom
    namespaced = dict(item_namespaced)
    tools, custom = _tools(req.tools or [], "tools", None, namespaced)
    tools += item_tools
    custom |= item_custom
    context = Context(
        (*earlier.messages, *new_messages),
        tuple(item_tools),
        frozenset(item_custom),
        tuple(item_namespaced.items()),
    )
    messages = list(context.messages)
    if req.instructions:
        messages.insert(0, Message(role="system", content=req.instructions))
    generate = req.generate is not False
    if not messages and generate:
        raise RequestError("'input' is empty: there is nothing to answer.", param="input")
    effort = (req.reasoning or {}).get("effort")
    sampling = SamplingParams(
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        json_schema=_json_schema(req.text),
    )
    chat = ChatRequest(
        messages=messages,
        model=req.model,
        tools=tools,
        tool_choice=_tool_choice(req.tool_choice),
        sampling=sampling,
        stream=bool(req.stream),
        # reasoning.effort "none" turns the policy's thinking off; others keep its default.
        enable_thinking=False if effort == "none" else None,
    )
    echo = {
        "instructions": req.instructions,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls
        if req.parallel_tool_calls is not None
        else True,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "text": req.text or {"format": {"type": "text"}},
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "previous_response_id": req.previous_response_id,
        "metadata": req.metadata or {},
        "prompt_cache_key": req.prompt_cache_key,
        "store": req.store if req.store is not None else True,
    }
    return ResponsesRequest(
        chat=chat,
        context=context,
        custom_tools=frozenset(custom),
        include_encrypted=INCLUDE_ENCRYPTED in (req.include or []),
        store=req.store if req.store is not None else True,
        previous_response_id=req.previous_response_id,
        echo=echo,
        namespaces=namespaced,
        generate=generate,
    )
