"""A vLLM worker extension (``--worker-extension-cls policy_server.worker.AgentTapWorker``) that
makes an in-place weight reload exact on vLLM's CPU backend. Imported inside vLLM's own
environment (.venv-vllm), never by the proxy.

Why it is needed: on a CPU, vLLM prepares a copy of each linear layer's weight for its GEMM
kernels when the model loads (``dispatch_cpu_unquantized_gemm``: a oneDNN handle or a packed
matrix, closed over by ``layer.cpu_linear``). ``reload_weights`` re-prepares a layer only when
the checkpoint holds that layer's own weights. A model with tied embeddings
(``tie_word_embeddings``: Qwen3-0.6B to 4B, Qwen2.5-0.5B to 3B, Llama-3.2-1B/3B) saves
``model.embed_tokens.weight`` and no ``lm_head.weight``: the shared tensor is refreshed in
place, but the output layer's prepared copy is the one made at start. Such a server computes
its hidden states with the new weights and its logits with the old embedding, a silent mix.

``agenttap_reload_weights(weights_path)`` is vLLM's ``reload_weights`` followed by preparing
again every layer that keeps its weight beside a prepared copy (embeddings and output heads;
linear layers drop their weight once prepared, and were prepared again by the reload
itself). agenttap calls it over ``POST /collective_rpc`` where the server has it
(``python -m policy_server`` starts vLLM with it) and plain ``reload_weights``
elsewhere, and checks the result with the trainer's probe either way
(capture/policy/weights.py).

**Seeded requests on a CPU** (``seed`` in the sampling parameters: a seeded rollout's calls, or
any client's). vLLM samples a token for every request of a step, also for a prompt whose
prefill is only partly done (a long prompt is prefilled in chunks), throws that token away,
and rewinds the request's generator (``set_offset(get_offset() - 4)``, the CUDA generator's
Philox offset). A CPU generator has no offset: the call raises and the engine dies, taking
every call in flight with it. ``patch_cpu_seeded_chunks`` (applied when vLLM imports this
module in its worker) rewinds a CPU generator the way it can be: its state from before the
step's sampling is put back, so a seeded request draws only for the tokens it keeps, the same
draws however its prompt was chunked.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from policy_server.lora_logits import patch_lora_prompt_logprobs
from policy_server.pin import version_warning


class AgentTapWorker:
    """Methods added to vLLM's worker (vLLM mixes this class into its worker class)."""

    def agenttap_reload_weights(self, weights_path: str) -> list[str]:
        """Reload the weights in ``weights_path`` in place, then prepare again the layers whose
        kernel copies a reload does not refresh; the names of those layers."""
        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        return refresh_prepared_layers(worker.get_model())


def refresh_prepared_layers(model: Any) -> list[str]:
    """Prepare again (``process_weights_after_loading``) every layer that holds a non-empty 2-D
    weight next to a kernel copy of it (``cpu_linear``); the names of those layers. Nothing
    to do off the CPU backend (no layer has ``cpu_linear`` there)."""
    refreshed = []
    for name, layer in model.named_modules():
        weight = getattr(layer, "weight", None)
        method = getattr(layer, "quant_method", None)
        if (
            getattr(layer, "cpu_linear", None) is None
            or method is None
            or weight is None
            or weight.ndim != 2
            or weight.numel() == 0
        ):
            continue
        method.process_weights_after_loading(layer)
        refreshed.append(name)
    return refreshed


def patch_cpu_seeded_chunks() -> bool:
    """Make vLLM's model runner rewind a CPU generator of a request whose sampled token it
    throws away (see the module's docstring) by its state, not its offset (idempotent); False
    where this vLLM has no such runner."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    if getattr(GPUModelRunner._sample, "agenttap_cpu_rewind", False):
        return True
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def thrown_away(runner: Any) -> dict[int, Any]:
        """Batch index -> CPU generator, for the requests whose token this step discards."""
        batch = runner.input_batch
        mask = runner.discard_request_mask.np[: batch.num_reqs]
        found = {}
        for index in mask.nonzero()[0]:
            gen = batch.generators.get(int(index))
            if gen is not None and gen.device.type == "cpu":
                found[int(index)] = gen
        return found

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        states = {i: gen.get_state() for i, gen in thrown_away(self).items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for index, state in states.items():  # the draws for a discarded token, undone
                self.input_batch.generators[index].set_state(state)

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = thrown_away(self)  # rewound already: kept from the offset rewind, which raises
        for index in held:
            del self.input_batch.generators[index]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(held)

    _sample.agenttap_cpu_rewind = True  # type: ignore[attr-defined]
    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    return True


def warn_if_not_pinned() -> str:
    """Write to vLLM's log (stderr) that this vLLM is not the one these patches were written
    for (policy_server/pin.py); the warning, "" where it is the pinned one."""
    try:
        import vllm
    except ImportError:
        return ""
    warning = version_warning(getattr(vllm, "__version__", None))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    return warning


warn_if_not_pinned()
patch_cpu_seeded_chunks()
# Prompt logprobs under a LoRA adapter in a step of several requests (lora_logits.py).
patch_lora_prompt_logprobs()
