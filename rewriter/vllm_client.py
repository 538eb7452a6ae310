"""Client for vLLM's token-in/token-out completions API.

The proxy never sends text to the policy: it sends the exact prompt token ids it rendered and
asks for the sampled token ids and their logprobs back (``return_tokens_as_token_ids``,
``logprobs=0``), so what is recorded is what the policy did. See ``docs/ARCHITECTURE.md``.

Two vLLM endpoints can do this. ``POST /v1/completions`` (token-id prompt) works on every vLLM.
``POST /inference/v1/generate`` (served with ``--enable-scale-out``) also reports which weight
version sampled which output tokens (``weight_versions``); it is used whenever the server has it
(asked once per server), with the server's default sampling parameters learned from
``POST /v1/completions/render`` so that both endpoints sample alike.

The request a generation sends: ``rewriter/vllm_request.py``; its stream as read (lines, the
text of a resumed generation): ``rewriter/vllm_stream.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from types import TracebackType
from typing import Any

import aiohttp

from rewriter.canonical import SamplingParams
from rewriter.ids_json import ids_json
from rewriter.policy_url import parse_policy_url, serves
from rewriter.vllm_answers import (
    Completion,
    CompletionDelta,
    PolicyError,
    WeightSpan,
    answer_choices,
    answer_json,
    answer_object,
    checked_logprob,
    completions_delta,
    generate_delta,
    is_int,
    malformed_answer,
    typed_field,
)
from rewriter.vllm_request import (
    GENERATE_PATH,
    JSON_CONTENT,
    SERVER_DEFAULTS,
    PolicyInfo,
    RawJson,
    dump_body,
    generation_body,
)
from rewriter.vllm_stream import (
    LineSplitter,
    Pacer,
    ResumedText,
    earliest,
    passed,
    read_pieces,
    stream_line_limit,
)

__all__ = ["Completion", "CompletionDelta", "PolicyError", "PolicyInfo", "VLLMClient"]

logger = logging.getLogger(__name__)

MAX_RESUMES = 16
# vLLM's own label of the weights it started with (its GET /weight_info before any update).
DEFAULT_WEIGHT_VERSION = "default"
# Servers a generation may move to after the one sampling it failed (see stream_resuming).
MAX_FAILOVERS = 8


def _may_fail_over(exc: BaseException) -> bool:
    """Whether another server may succeed where this one failed: no answer, a cut or stalled
    stream, overloaded (429 / 503); not a request the server refused as such (4xx)."""
    return not isinstance(exc, PolicyError) or exc.unavailable


Failover = Callable[["VLLMClient", BaseException], Awaitable["VLLMClient | None"]]


class _Bounded:
    """``asyncio.timeout_at(deadline)``, listed in ``bounds`` while it runs. A class, not a
    generator-based context manager: a stream enters one per read, for every token.
    ``abandoned``: the deadline was made to expire early (``VLLMClient.abandon``)."""

    __slots__ = ("_bounds", "_timeout", "abandoned")

    def __init__(self, bounds: set[_Bounded], deadline: float | None) -> None:
        self._bounds = bounds
        self._timeout = asyncio.timeout_at(deadline)
        self.abandoned = False

    def expire(self, now: float) -> None:
        self.abandoned = True
        self._timeout.reschedule(now)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()
        self._bounds.add(self)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bounds.discard(self)
        await self._timeout.__aexit__(kind, exc, tb)  # raises TimeoutError where it expired


class VLLMClient:
    """``base_url``: the server, ``http://HOST:PORT`` or ``unix:/PATH`` (its socket; then
    ``session`` must connect to that socket: ``rewriter.policy_url.connector``). ``api``:
    ``auto`` (the generate endpoint where the server has it, else ``/v1/completions``),
    ``completions`` or ``generate``."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        api: str = "auto",
        decode: Callable[[list[int]], str] | None = None,
        progress_timeout_s: float | None = None,
        flush_interval_s: float = 0.0,
    ) -> None:
        """``decode``: the policy tokenizer's decode (special tokens skipped, as vLLM is asked
        to); with it, the text of a generation resumed after an abort is computed here.

        ``progress_timeout_s``: the longest a generation may go without a new token (the first
        one included) before it fails. The connection's own read timeout is reset by any byte,
        so a stalled server sending keep-alives (blank lines, ``: ping``, chunks without
        tokens) would never trip it; this deadline moves only when tokens or the finish do.

        ``flush_interval_s``: the least time between two pieces a stream hands on (0: each
        read's tokens at once; rewriter/vllm_stream.py ``Pacer``). Tokens that come sooner wait
        in the response's buffer, not parsed, and go on together with the next (``coalesce``):
        one event to the client, one relay through mitmproxy, for several tokens. A
        generation's first piece and its finish are never held, so neither the time to the
        first token nor the end of the answer moves."""
        if api not in ("auto", "completions", "generate"):
            raise ValueError(f"api must be auto, completions or generate, not {api!r}")
        address = parse_policy_url(base_url)
        if not serves(session, address.url):
            raise ValueError(
                f"the HTTP session given for {address.url} does not connect to it (a unix "
                "socket's server needs a session on rewriter.policy_url.connector(url))"
            )
        # The server's name (logs, replicas, rows' backend); requests go to ``url(path)``.
        self.base_url = address.url.rstrip("/")
        self._http_base = address.http_base
        self._session = session
        self._api = api
        self._decode = decode
        self.progress_timeout_s = progress_timeout_s
        if flush_interval_s < 0:
            raise ValueError(f"flush_interval_s must be 0 or more, not {flush_interval_s!r}")
        self.flush_interval_s = flush_interval_s
        self._info: PolicyInfo | None = None
        # Which weights the server samples with, as agenttap knows them (POST /policy/weights
        # or /policy/version): the label of the tokens a server does not label itself
        # (/v1/completions reports no version). ``incoming_version``: the weights being loaded
        # now; a generation started meanwhile runs only once they serve (the server is paused).
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.incoming_version: str | None = None
        # Versions this server failed to load: a generation that started while it tried ran
        # on the weights it kept.
        self.failed_versions: set[str] = set()
        # The probe under way: concurrent first calls all wait for this one.
        self._probing: asyncio.Task[PolicyInfo] | None = None
        # While a weight update loads and verifies: generations (and resubmissions of those
        # its pause aborted) wait for it here rather than in vLLM's queue, so that none runs
        # on weights not verified yet (capture/policy/weights.py). None: nothing to wait for.
        self.hold: asyncio.Event | None = None
        # Why generations must not run here ("": they may): the server failed an update's
        # check, or its weights changed without one. A generation waiting here fails over.
        self.refuse = ""
        # Whether the server has agenttap's exact reload (policy_server/worker.py): None
        # until the first weight update asks.
        self.exact_reload: bool | None = None
        # The LoRA adapter generations ask for (vLLM serves it under this name, loaded by
        # POST /policy/weights {"lora": DIR}); None: the base model.
        self.lora: str | None = None
        # The deadlines generations wait under here (``abandon`` ends them early).
        self._bounds: set[_Bounded] = set()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The connection pool this server is reached through (TCP, or its unix socket)."""
        return self._session

    def url(self, path: str) -> str:
        """What an HTTP request for ``path`` on this server is addressed to."""
        return f"{self._http_base}{path}"

    def sampling_version(self) -> str:
        """The weights a generation started now samples with: during an update, the incoming
        ones (the server is paused; a generation that ran before the pause is aborted by it
        and resumed, and each piece keeps the label of the weights it ran under)."""
        return self.incoming_version or self.weight_version

    async def admitted(self) -> None:
        """Wait while a weight update loads and verifies here; PolicyError (retryable) where
        this server's weights are not to be used (``refuse``)."""
        hold = self.hold
        if hold is not None:
            await hold.wait()
        if self.refuse:
            raise PolicyError(
                f"the policy server at {self.base_url} is out of rotation: {self.refuse}", 503
            )

    def ran_under(self, label: str) -> str:
        """The weights a piece labelled ``label`` at its start really ran under: the ones this
        server kept, where it failed to load ``label``."""
        return self.weight_version if label in self.failed_versions else label

    async def info(self) -> PolicyInfo:
        """The served model's name and context length (asked once, then remembered).

        Single-flight: callers arriving while the probe runs await that same probe (a burst of
        first calls probes the server once, not once each). A failed probe is not remembered,
        so a later call asks again; a caller that is cancelled (its client left) does not
        cancel the probe the others wait for."""
        if self._info is not None:
            return self._info
        if self._probing is None:
            self._probing = asyncio.get_running_loop().create_task(self._probe())
            self._probing.add_done_callback(self._probed)
        return await asyncio.shield(self._probing)

    def _probed(self, task: asyncio.Task[PolicyInfo]) -> None:
        self._probing = None
        if not task.cancelled() and task.exception() is None:  # retrieved: never "unhandled"
            self._info = task.result()

    async def _probe(self) -> PolicyInfo:
        try:
            async with asyncio.timeout(self.progress_timeout_s):
                async with self._session.get(self.url("/v1/models")) as resp:
                    if resp.status != 200:
                        raise PolicyError(
                            f"{self.base_url}/v1/models answered {resp.status}", resp.status
                        )
                    raw = await resp.read()
        except TimeoutError as exc:
            raise self._stalled() from exc
        except aiohttp.ClientError as exc:
            raise PolicyError(f"cannot reach the policy server at {self.base_url}: {exc}") from exc
        listing = typed_field(
            answer_object(answer_json(raw, "a model listing"), "a model listing"), "data", list
        )
        if not listing:
            raise malformed_answer("a model listing without models", raw)
        model = answer_object(listing[0], "a model")
        name, max_len = model.get("id"), model.get("max_model_len")
        if not isinstance(name, str) or not (max_len is None or is_int(max_len)):
            raise malformed_answer("a model without a name or with a bad max_model_len", model)
        info = PolicyInfo(model=name, max_model_len=max_len)
        if self._api != "completions":
            info.generate = self._api == "generate" or await self._has_generate()
        if info.generate:
            info.sampling_defaults = await self._sampling_defaults(info.model)
        self._info = info
        return info

    def _stalled(self) -> PolicyError:
        limit = self.progress_timeout_s
        why = f" (no new token for {limit:g} s)" if limit else ""
        return PolicyError(
            f"the policy server at {self.base_url} did not answer in time{why}; "
            "option agenttap_policy_timeout"
        )

    def _bounded(self, deadline: float | None) -> _Bounded:
        """``asyncio.timeout_at(deadline)`` for a generation's wait on this server, which
        ``abandon`` can make expire at once."""
        return _Bounded(self._bounds, deadline)

    def abandon(self) -> int:
        """Every generation waiting on this server now fails as stalled (retryable: with a
        failover it goes on on another server from its tokens so far): the server was found
        paused or asleep, where it would wait for the policy timeout. How many were waiting."""
        now = asyncio.get_running_loop().time()
        bounds = list(self._bounds)
        for bound in bounds:
            bound.expire(now)
        return len(bounds)

    def _deadline(self) -> float | None:
        """When a generation that makes no progress from now on fails (None: never)."""
        if self.progress_timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.progress_timeout_s

    async def _has_generate(self) -> bool:
        """Whether the server serves the generate endpoint: an empty body is refused as
        invalid (400/422) where it does; 404 where it is absent, 403 where it is disabled."""
        try:
            async with self._session.post(self.url(GENERATE_PATH), json={}) as resp:
                available = resp.status in (400, 422)
        except aiohttp.ClientError:
            return False
        if available:
            logger.info("%s: token ids go to vLLM's %s", self.base_url, GENERATE_PATH)
        else:
            logger.info(
                "%s: this server has no %s; token ids go to /v1/completions instead (the same "
                "tokens and logprobs; nothing to do)",
                self.base_url,
                GENERATE_PATH,
            )
        return available

    async def _sampling_defaults(self, model: str) -> dict[str, Any]:
        body = {"model": model, "prompt": [0], "max_tokens": 1}
        try:
            async with self._session.post(self.url("/v1/completions/render"), json=body) as resp:
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
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool,
        prompt_json: str | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The endpoint and body for one generation (``prompt_json``: the ids' JSON text)."""
        return generation_body(await self.served(), prompt_ids, params, stream, prompt_json)

    async def served(self) -> PolicyInfo:
        """``info()`` with the model name generations ask for: the LoRA adapter's if one is
        loaded (``lora``), else the served model's."""
        info = await self.info()
        return replace(info, model=self.lora) if self.lora else info

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        try:
            resp = await self._session.post(
                self.url(path), data=dump_body(body), headers=headers or JSON_CONTENT
            )
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

    async def complete(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        failover: Failover | None = None,
        prompt_json: str | None = None,
    ) -> Completion:
        """A whole completion; generations aborted by the server (weight sync) are resumed, and
        with ``failover`` a server that fails is replaced (see :meth:`stream_resuming`)."""
        out = Completion()
        async for delta in self.stream_resuming(
            prompt_ids, params, stream=False, failover=failover, prompt_json=prompt_json
        ):
            out.extend(delta)
        return out

    async def stream_resuming(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = True,
        failover: Failover | None = None,
        prompt_json: str | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Like :meth:`stream`, but a generation the server ends with ``finish_reason: abort``
        (a paused server, a weight sync) is resubmitted with the tokens so far appended to the
        prompt and the remaining budget, and stitched: the caller sees one completion.

        ``failover(client, error)``: called when the server fails in a way another server may
        not (no answer, a cut or stalled stream, 429 / 503); the client it returns goes on
        from the tokens so far, the same way (None: the error is raised). Each piece says
        which server sampled it (``backend``). ``prompt_json``: ``prompt_ids`` as JSON text
        (rewriter/ids_json.py), sent as it is while no token was sampled yet."""
        sampled: list[int] = []
        emitted: list[str] = []  # the text yielded so far
        resumed: ResumedText | None = None
        current = self
        aborts = failovers = 0
        # Spans of this completion's tokens the servers did not label (see sampling_version),
        # handed on with the next piece yielded.
        unlabelled: list[WeightSpan] = []
        while True:
            before = len(sampled)
            try:
                await current.admitted()
            except PolicyError as exc:
                if failover is None or failovers >= MAX_FAILOVERS:
                    raise
                replacement = await failover(current, exc)
                if replacement is None:
                    raise
                current, failovers = replacement, failovers + 1
                continue
            label = current.sampling_version()
            labelled = False
            budget = replace(
                params,
                max_tokens=None if params.max_tokens is None else params.max_tokens - len(sampled),
                min_tokens=None
                if params.min_tokens is None
                else max(0, params.min_tokens - len(sampled)),
            )
            aborted = False
            ids = prompt_ids + sampled if sampled else prompt_ids
            text = prompt_json if not sampled else None
            parts = (
                current.stream(ids, budget, prompt_json=text)
                if stream
                else current._complete_once(ids, budget, prompt_json=text)
            )
            try:
                async for delta in parts:
                    if delta.finish_reason == "abort":
                        aborted = True
                        delta.finish_reason = None
                    # The server's spans count this generation's tokens; the caller's, the whole.
                    delta.weight_versions = [
                        (v, start + before, end + before) for v, start, end in delta.weight_versions
                    ]
                    labelled = labelled or bool(delta.weight_versions)
                    delta.backend = current.base_url
                    sampled.extend(delta.token_ids)
                    if unlabelled:
                        delta.weight_versions[:0] = unlabelled
                        unlabelled = []
                    if aborted or delta.finish_reason is not None:
                        # The piece's last: where the server labelled none of its tokens, the
                        # weights it ran under (see sampling_version) label them all.
                        if not labelled and len(sampled) > before:
                            span = (current.ran_under(label), before, len(sampled))
                            delta.weight_versions.append(span)
                    if resumed is not None:
                        delta.text = resumed.step(sampled, final=delta.finish_reason is not None)
                    emitted.append(delta.text)
                    yield delta
            except (PolicyError, aiohttp.ClientError, TimeoutError) as exc:
                if failover is None or failovers >= MAX_FAILOVERS or not _may_fail_over(exc):
                    raise
                replacement = await failover(current, exc)
                if replacement is None:
                    raise
                if not labelled and len(sampled) > before:
                    unlabelled.append((current.ran_under(label), before, len(sampled)))
                current, failovers = replacement, failovers + 1
            else:
                if not aborted:
                    return
                aborts += 1
                if aborts > MAX_RESUMES:
                    raise PolicyError(f"generation aborted {aborts} times; giving up")
                logger.info("generation aborted by the policy server; resuming (%d)", aborts)
            if params.max_tokens is not None and len(sampled) >= params.max_tokens:
                yield CompletionDelta(
                    "",
                    [],
                    [],
                    finish_reason="length",
                    weight_versions=unlabelled,
                    backend=current.base_url,
                )
                return
            if self._decode is not None and resumed is None and (aborted or sampled):
                # vLLM detokenizes a resubmission from its prompt: where the tokens so far end
                # inside a character (a byte-level token), its first text can repeat the whole
                # prompt. From here on the text is decoded from the stitched ids instead.
                resumed = ResumedText.start(self._decode, sampled, "".join(emitted))

    async def _complete_once(
        self, prompt_ids: list[int], params: SamplingParams, prompt_json: str | None = None
    ) -> AsyncIterator[CompletionDelta]:
        path, body = await self._body(prompt_ids, params, stream=False, prompt_json=prompt_json)
        # A whole answer's tokens all come at once: the body must be in within the timeout
        # (a server trickling whitespace into it makes no progress).
        try:
            async with self._bounded(self._deadline()):
                resp = await self._post(path, body)
                async with resp:
                    raw = await resp.read()
        except TimeoutError as exc:
            raise self._stalled() from exc
        parse = generate_delta if path == GENERATE_PATH else completions_delta
        choices = answer_choices(answer_json(raw, "an answer"))
        if not choices:
            raise malformed_answer("an answer without choices", raw)
        delta = parse(choices[0])
        if delta.finish_reason is None:
            raise malformed_answer(
                "an answer whose generation did not finish (no finish_reason)", raw
            )
        yield delta

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, prompt_json: str | None = None
    ) -> AsyncIterator[CompletionDelta]:
        """One generation's pieces as the server sends them. Whatever is not vLLM's SSE (a
        line that is not JSON, a chunk of the wrong shape), a stream that ends before the
        generation did (no finish_reason, no ``[DONE]``) and a stream without a new token for
        ``progress_timeout_s`` raise PolicyError: the caller answers it as an error, never
        as a complete answer."""
        path, body = await self._body(prompt_ids, params, stream=True, prompt_json=prompt_json)
        parse = generate_delta if path == GENERATE_PATH else completions_delta
        deadline = self._deadline()
        try:
            async with self._bounded(deadline):
                resp = await self._post(path, body)
        except TimeoutError as exc:
            raise self._stalled() from exc
        finished = False
        lines = LineSplitter(stream_line_limit(len(prompt_ids)))
        fast = path != GENERATE_PATH  # vLLM's /v1/completions lines: completions_stream_line
        pacer = Pacer(self.flush_interval_s)
        loop = asyncio.get_running_loop()
        content = resp.content
        # While pieces are held (``pacer.holding``), the stream waits for the interval's end
        # without reading: the tokens that come meanwhile wait in the response's buffer (the
        # event loop still moves each from the socket; this task is not woken for it) and are
        # parsed in one go. The stream's end ends that wait. Pausing the socket's reads as well
        # saved nothing measurable and would hold the finish until the interval ended.
        sleeping: list[asyncio.Future[None]] = []

        def woken() -> None:
            for waiter in sleeping:
                if not waiter.done():
                    waiter.set_result(None)

        if pacer.interval:
            content.on_eof(woken)
        async with resp:
            while True:
                # Bounded per wait, never across a yield: the caller's own awaits (writing to
                # a slow client) are not the policy's time.
                try:
                    if pacer.holding(loop.time()) and not content.is_eof():
                        waiter = loop.create_future()
                        sleeping[:] = [waiter]
                        bound = self._bounded(earliest(deadline, pacer.next_flush))
                        try:
                            async with bound:
                                await waiter
                        except TimeoutError:
                            if bound.abandoned:
                                raise
                        # The interval is over, or the policy's deadline came: what came
                        # meanwhile is read now; nothing at all by the deadline is a stall.
                        data = content.read_nowait(-1)
                        ended = not data and content.at_eof()
                        if not data and not ended and passed(deadline, loop.time()):
                            raise TimeoutError
                    else:
                        async with self._bounded(deadline):
                            data = await content.readany()
                        ended = not data
                except (TimeoutError, aiohttp.ClientError) as exc:
                    # What was read before the failure goes on first, as it came.
                    for delta in pacer.release():
                        yield delta
                    if isinstance(exc, TimeoutError):  # ours, or the connection's read timeout
                        raise self._stalled() from exc
                    raise
                # Every line already here is parsed before any is handed on: the tokens that
                # came in one read (the policy ran ahead of this proxy or of its client) go on
                # as one piece, one event to the client rather than one per token; so do those
                # that came within ``flush_interval_s`` of the last piece (``Pacer``).
                fed = lines.rest() if ended else lines.feed(data) if data else []
                read = read_pieces(fed, parse, fast)
                if read.progress:
                    deadline = self._deadline()
                finished = finished or read.finished
                final = read.finished or read.done or ended or read.error is not None
                for delta in pacer.take(read.pieces, loop.time(), final):
                    yield delta
                if read.error is not None:
                    raise read.error
                if read.done:
                    return
                if ended:
                    break
        if not finished:
            # Status 0: the server went away mid-generation (a crash, a restart): retryable.
            raise PolicyError(
                f"the policy server at {self.base_url} ended its stream before the generation "
                "finished (no finish_reason, no [DONE]); the answer is incomplete"
            )

    async def prompt_logprobs(self, ids: list[int], check: bool = False) -> list[float | None]:
        """Log-probability of each token of ``ids`` given the ones before it (entry 0: None).
        It is a 1-token generation too: agenttap's health checks and weight fingerprints
        (``check``: its request id says so, ``agenttap-check-...``, in vLLM's logs)."""
        headers = None
        if check:
            headers = {**JSON_CONTENT, "X-Request-Id": f"agenttap-check-{uuid.uuid4().hex[:12]}"}
        info = await self.served()
        body = {
            "model": info.model,
            "prompt": RawJson(ids_json(ids)),  # tens of thousands of ids: orjson writes them
            "max_tokens": 1,
            "prompt_logprobs": 0,
        }
        try:
            async with asyncio.timeout_at(self._deadline()):
                resp = await self._post("/v1/completions", body, headers)
                async with resp:
                    raw = await resp.read()
        except TimeoutError as exc:
            raise self._stalled() from exc
        choices = answer_choices(answer_json(raw, "an answer"))
        try:
            entries = choices[0]["prompt_logprobs"]
            out: list[float | None] = []
            for token, entry in zip(ids, entries, strict=True):
                out.append(None if entry is None else checked_logprob(entry[str(token)]["logprob"]))
        except (KeyError, IndexError, TypeError, ValueError):
            raise malformed_answer(
                "prompt_logprobs that do not match the prompt", raw[:200]
            ) from None
        return out
