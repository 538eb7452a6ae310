"""Client for vLLM's token-in/token-out completions API.

The proxy never sends text to the policy: it sends the exact prompt token ids it rendered and
asks for the sampled token ids and their logprobs back (``return_token_ids``, ``logprobs=0``),
so what is recorded is what the policy did. See ``docs/ARCHITECTURE.md``.

Two vLLM endpoints can do this. ``POST /v1/completions`` (token-id prompt) works on every vLLM.
``POST /inference/v1/generate`` (served with ``--enable-scale-out``) also reports which weight
version sampled which output tokens (``weight_versions``); it is used whenever the server has it
(asked once per server), with the server's default sampling parameters learned from
``POST /v1/completions/render`` so that both endpoints sample alike.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from rewriter.canonical import SamplingParams

logger = logging.getLogger(__name__)

MAX_RESUMES = 16
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

    def extend(self, delta: CompletionDelta) -> None:
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


def _choice_delta(choice: dict[str, Any]) -> CompletionDelta:
    """A choice of ``/v1/completions``."""
    lp = choice.get("logprobs") or {}
    logprobs = [float(x) if x is not None else 0.0 for x in (lp.get("token_logprobs") or [])]
    return _delta(choice, logprobs, [])


def _generate_delta(choice: dict[str, Any]) -> CompletionDelta:
    """A choice of ``/inference/v1/generate`` (``output_mode: text``); spans are the part's."""
    content = (choice.get("logprobs") or {}).get("content") or []
    spans = [
        (str(s["version"]), int(s["start"]), int(s["end"]))
        for s in choice.get("weight_versions") or []
    ]
    return _delta(choice, [float(x.get("logprob", 0.0)) for x in content], spans)


def _delta(
    choice: dict[str, Any], logprobs: list[float], spans: list[WeightSpan]
) -> CompletionDelta:
    """The fields both endpoints spell alike, with the logprobs and spans each spells its way."""
    ids = list(choice.get("token_ids") or [])
    if len(logprobs) != len(ids):
        raise PolicyError(
            f"policy returned {len(ids)} token ids but {len(logprobs)} logprobs; "
            "is it a vLLM server that returns token ids?"
        )
    return CompletionDelta(
        text=choice.get("text") or "",
        token_ids=ids,
        logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        weight_versions=spans,
    )


@dataclass
class PolicyInfo:
    model: str
    max_model_len: int | None
    # The server answers POST /inference/v1/generate (weight versions per token span).
    generate: bool = False
    # Its default sampling parameters (generation_config.json), for the generate endpoint.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


class ResumedText:
    """Incremental text of a completion's ids (the classic prefix/read-offset detokenizer):
    a piece is emitted once it no longer ends inside a character."""

    def __init__(self, decode: Callable[[list[int]], str], prefix: int, read: int) -> None:
        self._decode = decode
        self._prefix = prefix  # ids before this only give context to the next piece
        self._read = read  # ids before this have had their text emitted

    @classmethod
    def start(
        cls, decode: Callable[[list[int]], str], ids: list[int], emitted: str
    ) -> ResumedText | None:
        """Pick up after ``emitted``, the text given out for ``ids`` so far (a server holds
        back a last incomplete character, so it may stand for a few ids less)."""
        for read in range(len(ids), max(-1, len(ids) - 8), -1):
            if decode(ids[:read]) == emitted:
                return cls(decode, max(0, read - 6), read)
        logger.warning("resumed generation: its text so far does not match its ids")
        return None

    def step(self, ids: list[int], final: bool = False) -> str:
        before = self._decode(ids[self._prefix : self._read])
        text = self._decode(ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return text[len(before) :]


class VLLMClient:
    """``api``: ``auto`` (the generate endpoint where the server has it, else
    ``/v1/completions``), ``completions`` or ``generate``."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        api: str = "auto",
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        """``decode``: the policy tokenizer's decode (special tokens skipped, as vLLM is asked
        to); with it, the text of a generation resumed after an abort is computed here."""
        if api not in ("auto", "completions", "generate"):
            raise ValueError(f"api must be auto, completions or generate, not {api!r}")
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._api = api
        self._decode = decode
        self._info: PolicyInfo | None = None

    async def info(self) -> PolicyInfo:
        """The served model's name and context length (asked once, then remembered)."""
        if self._info is None:
            try:
                async with self._session.get(f"{self.base_url}/v1/models") as resp:
                    if resp.status != 200:
                        raise PolicyError(
                            f"{self.base_url}/v1/models answered {resp.status}", resp.status
                        )
                    data = await resp.json()
            except aiohttp.ClientError as exc:
                raise PolicyError(
                    f"cannot reach the policy server at {self.base_url}: {exc}"
                ) from exc
            model = data["data"][0]
            info = PolicyInfo(model=model["id"], max_model_len=model.get("max_model_len"))
            if self._api != "completions":
                info.generate = self._api == "generate" or await self._has_generate()
            if info.generate:
                info.sampling_defaults = await self._sampling_defaults(info.model)
            self._info = info
        return self._info

    async def _has_generate(self) -> bool:
        """Whether the server serves the generate endpoint: an empty body is refused as
        invalid (400/422) where it does; 404 where it is absent, 403 where it is disabled."""
        try:
            async with self._session.post(f"{self.base_url}{GENERATE_PATH}", json={}) as resp:
                available = resp.status in (400, 422)
        except aiohttp.ClientError:
            return False
        logger.info(
            "%s: %s",
            self.base_url,
            "using " + GENERATE_PATH if available else "no generate endpoint",
        )
        return available

    async def _sampling_defaults(self, model: str) -> dict[str, Any]:
        body = {"model": model, "prompt": [0], "max_tokens": 1}
        try:
            async with self._session.post(
                f"{self.base_url}/v1/completions/render", json=body
            ) as resp:
                data = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, ValueError):
            data = None
        if not isinstance(data, list) or not data:
            logger.warning(
                "%s: /v1/completions/render did not answer; the generate endpoint samples with "
                "vLLM's neutral defaults where a request sets none",
                self.base_url,
            )
            return {}
        params = data[0].get("sampling_params") or {}
        return {k: params[k] for k in SERVER_DEFAULTS if params.get(k) is not None}

    async def _body(
        self, prompt_ids: list[int], params: SamplingParams, stream: bool
    ) -> tuple[str, dict[str, Any]]:
        """The endpoint and body for one generation."""
        info = await self.info()
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
                "token_ids": prompt_ids,
                "sampling_params": {**info.sampling_defaults, **sampling},
                "output_mode": "text",  # the text (stop strings applied) for the parsers
                "stream": stream,
            }
        body = {
            "model": info.model,
            "prompt": prompt_ids,
            "return_token_ids": True,
            "stream": stream,
            **sampling,
        }
        return "/v1/completions", body

    async def _post(self, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        try:
            resp = await self._session.post(f"{self.base_url}{path}", json=body)
        except aiohttp.ServerTimeoutError as exc:
            raise PolicyError(
                f"the policy server at {self.base_url} did not answer in time ({exc}); "
                "option agenttap_policy_timeout"
            ) from exc
        except aiohttp.ClientError as exc:
            raise PolicyError(f"cannot reach the policy server at {self.base_url}: {exc}") from exc
        if resp.status != 200:
            text = await resp.text()
            resp.release()
            try:
                message = json.loads(text).get("error", {}).get("message") or text
            except (json.JSONDecodeError, AttributeError):
                message = text
            raise PolicyError(f"policy server answered {resp.status}: {message}", resp.status)
        return resp

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """A whole completion; generations aborted by the server (weight sync) are resumed."""
        out = Completion()
        async for delta in self.stream_resuming(prompt_ids, params, stream=False):
            out.extend(delta)
        return out

    async def stream_resuming(
        self, prompt_ids: list[int], params: SamplingParams, *, stream: bool = True
    ) -> AsyncIterator[CompletionDelta]:
        """Like :meth:`stream`, but a generation the server ends with ``finish_reason: abort``
        (a paused server, a weight sync) is resubmitted with the tokens so far appended to the
        prompt and the remaining budget, and stitched: the caller sees one completion."""
        sampled: list[int] = []
        emitted: list[str] = []  # the text yielded so far
        resumed: ResumedText | None = None
        for resume in range(MAX_RESUMES + 1):
            before = len(sampled)
            budget = replace(
                params,
                max_tokens=None if params.max_tokens is None else params.max_tokens - len(sampled),
                min_tokens=None
                if params.min_tokens is None
                else max(0, params.min_tokens - len(sampled)),
            )
            aborted = False
            parts = (
                self.stream(prompt_ids + sampled, budget)
                if stream
                else self._complete_once(prompt_ids + sampled, budget)
            )
            async for delta in parts:
                if delta.finish_reason == "abort":
                    aborted = True
                    delta.finish_reason = None
                # The server's spans count this generation's tokens; the caller's, the whole.
                delta.weight_versions = [
                    (v, start + before, end + before) for v, start, end in delta.weight_versions
                ]
                sampled.extend(delta.token_ids)
                if resumed is not None:
                    delta.text = resumed.step(sampled, final=delta.finish_reason is not None)
                emitted.append(delta.text)
                yield delta
            if not aborted:
                return
            if params.max_tokens is not None and len(sampled) >= params.max_tokens:
                yield CompletionDelta("", [], [], finish_reason="length")
                return
            logger.info("generation aborted by the policy server; resuming (%d)", resume + 1)
            if self._decode is not None and resumed is None:
                # vLLM detokenizes a resubmission from its prompt: where the tokens so far end
                # inside a character (a byte-level token), its first text can repeat the whole
                # prompt. From here on the text is decoded from the stitched ids instead.
                resumed = ResumedText.start(self._decode, sampled, "".join(emitted))
        raise PolicyError(f"generation aborted {MAX_RESUMES + 1} times; giving up")

    async def _complete_once(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[CompletionDelta]:
        path, body = await self._body(prompt_ids, params, stream=False)
        resp = await self._post(path, body)
        async with resp:
            data = await resp.json()
        parse = _generate_delta if path == GENERATE_PATH else _choice_delta
        yield parse(data["choices"][0])

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[CompletionDelta]:
        path, body = await self._body(prompt_ids, params, stream=True)
        parse = _generate_delta if path == GENERATE_PATH else _choice_delta
        resp = await self._post(path, body)
        async with resp:
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise PolicyError(f"policy stream failed: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    yield parse(choice)

    async def prompt_logprobs(self, ids: list[int]) -> list[float | None]:
        """Log-probability of each token of ``ids`` given the ones before it (entry 0: None)."""
        info = await self.info()
        body = {
            "model": info.model,
            "prompt": ids,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        resp = await self._post("/v1/completions", body)
        async with resp:
            data = await resp.json()
        entries = data["choices"][0]["prompt_logprobs"]
        out: list[float | None] = []
        for token, entry in zip(ids, entries, strict=True):
            out.append(None if entry is None else float(entry[str(token)]["logprob"]))
        return out
