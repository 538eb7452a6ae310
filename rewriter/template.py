"""Chat-template rendering to token ids with the policy's own tokenizer.

The tokenizer folder is the policy's (``tokenizer.json`` + ``tokenizer_config.json`` with its
``chat_template``); nothing is fetched from a hub.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError

from rewriter.canonical import Message, RequestError, ToolSpec

logger = logging.getLogger(__name__)


def _no_torch_notice(record: logging.LogRecord) -> bool:
    """transformers announces on import that PyTorch is missing; only its tokenizers are used
    here (the proxy's environment has no torch on purpose), so that notice is noise."""
    return not record.getMessage().startswith("PyTorch was not found")


# Set before transformers is imported (it logs the notice while it loads): transformers'
# own logger, so no other message is touched.
logging.getLogger("transformers").addFilter(_no_torch_notice)


def message_to_template_dict(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                # Templates serialize arguments with `tojson` when given a mapping.
                "function": {"name": call.name, "arguments": call.arguments_object()},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def tool_to_template_dict(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters or {"type": "object", "properties": {}},
        },
    }


@dataclass(frozen=True)
class TemplateTail:
    """What the template writes after an assistant turn's content, e.g. ``<|im_end|>\\n``."""

    text: str
    ids: tuple[int, ...]


class ChatTemplate:
    """The policy tokenizer plus its chat template."""

    def __init__(self, tokenizer_path: str | os.PathLike[str]) -> None:
        path = Path(tokenizer_path)
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
            raise FileNotFoundError(
                f"no tokenizer in {path}: give the folder holding the policy's tokenizer.json "
                "and tokenizer_config.json (with its chat_template)"
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer in {path} has no chat_template")
        self.eos_token_id: int = self.tokenizer.eos_token_id
        # The Rust tokenizer itself: its batch encoding releases the GIL and it is safe to share
        # between threads, so a long prompt is tokenized off the event loop
        # (capture/pipeline/turn.py) while other sessions' calls go on. None for a slow (Python)
        # tokenizer.
        self._backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._max_token_bytes: int | None = None
        self._tail = self._probe_assistant_tail()

    # -- rendering -------------------------------------------------------------------------
    def render_text(
        self,
        messages: list[Message],
        tools: list[ToolSpec] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> str:
        kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        try:
            text = self.tokenizer.apply_chat_template(
                [message_to_template_dict(m) for m in messages],
                tools=[tool_to_template_dict(t) for t in tools] if tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except TemplateError as exc:
            # A template's raise_exception refuses a conversation's shape (say, no user turn):
            # the request's doing, so the client's 400 with the template's own words.
            raise RequestError(
                f"The policy's chat template cannot render this conversation: {exc}"
            ) from None
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        # Chat templates write their own special tokens; never add a BOS here.
        if self._backend is not None:
            # encode_batch, not encode: only the batch call lets go of the GIL.
            return list(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token stands for."""
        if self._max_token_bytes is None:
            vocab = self.tokenizer.get_vocab()
            special = set(self.tokenizer.all_special_tokens) | set(self.tokenizer.get_added_vocab())
            # A byte-level vocabulary writes each byte as one character.
            byte_level = self._backend is not None and '"ByteLevel"' in self._backend.to_str()
            self._max_token_bytes = max(
                (
                    len(token)
                    if byte_level and token not in special
                    else len(token.encode("utf-8", "surrogatepass"))
                    for token in vocab
                ),
                default=1,
            )
        return self._max_token_bytes

    def special_tokens(self) -> list[str]:
        """The tokenizer's added and special tokens, in id order (the start-up check asks the
        policy server to tokenize them all)."""
        added = self.tokenizer.get_added_vocab()
        return sorted(added, key=added.__getitem__)

    def vocab_size(self) -> int:
        """Ids this tokenizer knows, added tokens included."""
        return len(self.tokenizer)

    def min_tokens(self, text_bytes: int) -> int:
        """At least how many tokens any text of ``text_bytes`` bytes takes: known before
        tokenizing it, so an over-long prompt is refused without that cost."""
        return text_bytes // max(1, self.max_token_bytes)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def render(
        self,
        messages: list[Message],
        tools: list[ToolSpec] | None = None,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        return self.encode(
            self.render_text(
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
            )
        )

    # -- the template's closing of an assistant turn ----------------------------------------
    @property
    def assistant_tail(self) -> TemplateTail:
        return self._tail

    def _probe_assistant_tail(self) -> TemplateTail:
        marker = "AGENTTAP_PROBE_CONTENT"
        probe = [
            Message(role="user", content="hi"),
            Message(role="assistant", content=marker),
            Message(role="user", content="again"),
        ]
        text = self.render_text(probe, add_generation_prompt=False)
        after = text[text.index(marker) + len(marker) :]
        # The tail is what follows the content up to where the next message begins.
        without_last = self.render_text(probe[:2], add_generation_prompt=False)
        tail = without_last[without_last.index(marker) + len(marker) :]
        if not after.startswith(tail):
            tail = ""
        return TemplateTail(text=tail, ids=tuple(self.encode(tail)))
