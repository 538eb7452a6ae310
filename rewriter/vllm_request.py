"""What a generation asks a vLLM server for: the endpoint and the body (``generation_body``:
the prompt's ids, vLLM's sampling parameters, ``return_tokens_as_token_ids``, ``logprobs=0``),
chosen by what the server is (``PolicyInfo``: its model, context length, generate endpoint and
sampling defaults), and written as compact JSON with a prompt's ids put in as they were
formatted (``RawJson``, ``dump_body``). rewriter/vllm_generate.py sends it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rewriter.canonical import SamplingParams
from rewriter.vllm_answers import sampling_to_vllm

GENERATE_PATH = "/inference/v1/generate"
# Sampling defaults /v1/completions takes from the model's generation_config.json and the
# generate endpoint does not: learned once from /v1/completions/render.
SERVER_DEFAULTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass
class PolicyInfo:
    model: str
    max_model_len: int | None
    # The server answers POST /inference/v1/generate (weight versions per token span).
    generate: bool = False
    # Its default sampling parameters (generation_config.json), for the generate endpoint.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


JSON_CONTENT = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class RawJson:
    """A request body value already formatted as JSON text (a prompt's ids)."""

    text: str


def dump_body(body: dict[str, Any]) -> bytes:
    """``body`` as compact JSON, its ``RawJson`` values put in as they are."""
    raw = {k: v.text for k, v in body.items() if isinstance(v, RawJson)}
    rest = json.dumps({k: v for k, v in body.items() if k not in raw}, separators=(",", ":"))
    if not raw:
        return rest.encode()
    parts = [f"{json.dumps(k)}:{text}" for k, text in raw.items()]
    if rest != "{}":
        parts.append(rest[1:-1])
    return ("{" + ",".join(parts) + "}").encode()


def generation_body(
    info: PolicyInfo,
    prompt_ids: list[int],
    params: SamplingParams,
    stream: bool,
    prompt_json: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """The endpoint and body for one generation on the server ``info`` describes
    (``prompt_json``: the ids' JSON text)."""
    prompt: list[int] | RawJson = prompt_ids if prompt_json is None else RawJson(prompt_json)
    sampling: dict[str, Any] = {
        "logprobs": 0,
        # Tags such as <tool_call> and <think> must reach the parsers; the EOS text must not.
        "skip_special_tokens": True,
    }
    sampling.update(sampling_to_vllm(params))
    if info.max_model_len:
        # vLLM's default is 16, and it refuses a max_tokens past the context; clients mean
        # "at most": no limit means until done, a limit over the room left means the room
        # (Claude Code asks for 128000 whatever the model).
        room = max(1, info.max_model_len - len(prompt_ids))
        sampling["max_tokens"] = min(sampling.get("max_tokens", room), room)
    if info.generate:
        return GENERATE_PATH, {
            "model": info.model,
            "token_ids": prompt,
            "sampling_params": {**info.sampling_defaults, **sampling},
            "output_mode": "text",  # the text (stop strings applied) for the parsers
            "stream": stream,
        }
    body = {
        "model": info.model,
        "prompt": prompt,
        # The sampled ids as logprobs' tokens ("token_id:N"), not return_token_ids: that one
        # also echoes the whole prompt's ids in the first chunk, which vLLM serializes and
        # sends on every call (7 ms of time to first token at 25k tokens on a CPU, growing
        # with the history) for nothing: they are the ids sent.
        "return_tokens_as_token_ids": True,
        "stream": stream,
        **sampling,
    }
    return "/v1/completions", body
