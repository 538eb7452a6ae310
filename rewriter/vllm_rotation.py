"""A policy server's weight-rotation state: which weights it samples with, the update loading on
it, and whether its generations may run there.

One ``Rotation`` per server. Its replica (capture/policy/replicas.py ``Replica.rotation``, one
object for every pool that lists the server) holds it and a weight update
(capture/policy/weights.py) writes it; the server's client (rewriter/vllm_client.py) only reads
it, to admit a generation, to label its tokens and to name the LoRA adapter it asks for.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rewriter.vllm_answers import PolicyError

# vLLM's own label of the weights it started with (its GET /weight_info before any update).
DEFAULT_WEIGHT_VERSION = "default"


@dataclass(eq=False)
class Rotation:
    # Which weights the server samples with, as agenttap knows them (POST /policy/weights or
    # /policy/version): the label of the tokens a server does not label itself
    # (/v1/completions reports no version).
    weight_version: str = DEFAULT_WEIGHT_VERSION
    # The weights being loaded now; a generation started meanwhile runs only once they serve
    # (the server is paused).
    incoming_version: str | None = None
    # Versions this server failed to load: a generation that started while it tried ran on
    # the weights it kept.
    failed_versions: set[str] = field(default_factory=set)
    # While a weight update loads and verifies: generations (and resubmissions of those its
    # pause aborted) wait for it here rather than in vLLM's queue, so that none runs on weights
    # not verified yet. None: nothing to wait for.
    hold: asyncio.Event | None = None
    # Why generations must not run here ("": they may): the server failed an update's check,
    # or its weights changed without one. A generation waiting here fails over.
    refuse: str = ""
    # Whether the server has agenttap's exact reload (policy_server/worker.py): None until the
    # first weight update asks.
    exact_reload: bool | None = None
    # The LoRA adapter generations ask for (vLLM serves it under this name, loaded by
    # POST /policy/weights {"lora": DIR}); None: the base model.
    lora: str | None = None

    def sampling_version(self) -> str:
        """The weights a generation started now samples with: during an update, the incoming
        ones (the server is paused; a generation that ran before the pause is aborted by it
        and resumed, and each piece keeps the label of the weights it ran under)."""
        return self.incoming_version or self.weight_version

    def ran_under(self, label: str) -> str:
        """The weights a piece labelled ``label`` at its start really ran under: the ones this
        server kept, where it failed to load ``label``."""
        return self.weight_version if label in self.failed_versions else label

    async def admitted(self, base_url: str) -> None:
        """Wait while a weight update loads and verifies on the server at ``base_url``;
        PolicyError (retryable) where its weights are not to be used (``refuse``)."""
        hold = self.hold
        if hold is not None:
            await hold.wait()
        if self.refuse:
            raise PolicyError(
                f"the policy server at {base_url} is out of rotation: {self.refuse}", 503
            )
