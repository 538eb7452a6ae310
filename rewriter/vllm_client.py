"""Client for vLLM's token-in/token-out completions API.

The proxy never sends text to the policy: it sends the exact prompt token ids it rendered and
asks for the sampled token ids and their logprobs back (``return_tokens_as_token_ids``,
``logprobs=0``), so what is recorded is what the policy did. See ``docs/ARCHITECTURE.md``.

Two vLLM endpoints can do this. ``POST /v1/completions`` (token-id prompt) works on every vLLM.
``POST /inference/v1/generate`` (served with ``--enable-scale-out``) also reports which weight
version sampled which output tokens (``weight_versions``); it is used whenever the server has it
(asked once per server), with the server's default sampling parameters learned from
``POST /v1/completions/render`` so that both endpoints sample alike.

``VLLMClient`` is put together from one module per concern: its HTTP and deadlines
(``rewriter/vllm_transport.py``), what it learns of the server (``vllm_probe.py``), one
generation (``vllm_generate.py``), a generation resumed and moved across servers
(``vllm_resume.py``) and prompt logprobs (``vllm_scoring.py``). The server's weight-rotation
state it reads is its replica's (``vllm_rotation.py``). The request a generation sends:
``rewriter/vllm_request.py``; its stream as read (lines, the text of a resumed generation):
``rewriter/vllm_stream.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from rewriter.canonical import SamplingParams
from rewriter.vllm_answers import Completion, CompletionDelta, PolicyError
from rewriter.vllm_generate import Generating
from rewriter.vllm_request import PolicyInfo
from rewriter.vllm_resume import MAX_FAILOVERS, MAX_RESUMES, stream_resuming
from rewriter.vllm_rotation import DEFAULT_WEIGHT_VERSION, Rotation
from rewriter.vllm_scoring import Scoring

__all__ = [
    "DEFAULT_WEIGHT_VERSION",
    "MAX_FAILOVERS",
    "MAX_RESUMES",
    "Completion",
    "CompletionDelta",
    "Failover",
    "PolicyError",
    "PolicyInfo",
    "VLLMClient",
]

Failover = Callable[["VLLMClient", BaseException], Awaitable["VLLMClient | None"]]


class VLLMClient(Generating, Scoring):
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
        super().__init__(base_url, session, progress_timeout_s, flush_interval_s)
        self._api = api
        self._decode = decode
        self._info = None
        self._probing = None
        # The server's weight-rotation state: the replicas listing the server hold and write
        # it (capture/policy/replicas.py ``Replica.rotation``); the client only reads it.
        self.rotation = Rotation()

    # Read-only views of the rotation state.
    @property
    def weight_version(self) -> str:
        """The weights the server samples with, as agenttap knows them."""
        return self.rotation.weight_version

    @property
    def incoming_version(self) -> str | None:
        """The weights a weight update is loading now (None: none is)."""
        return self.rotation.incoming_version

    @property
    def exact_reload(self) -> bool | None:
        """Whether the server has agenttap's exact reload (None: not asked yet)."""
        return self.rotation.exact_reload

    @property
    def lora(self) -> str | None:
        """The LoRA adapter generations ask for (None: the base model)."""
        return self.rotation.lora

    def sampling_version(self) -> str:
        """The weights a generation started now samples with (``Rotation.sampling_version``)."""
        return self.rotation.sampling_version()

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

    def stream_resuming(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool = True,
        failover: Failover | None = None,
        prompt_json: str | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """This server's generation, resumed across aborts and, with ``failover``, moved
        across servers (rewriter/vllm_resume.py ``stream_resuming``)."""
        return stream_resuming(
            self,
            prompt_ids,
            params,
            stream=stream,
            failover=failover,
            prompt_json=prompt_json,
            decode=self._decode,
        )
