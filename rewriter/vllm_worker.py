"""A vLLM worker extension (``--worker-extension-cls rewriter.vllm_worker.AgentTapWorker``) that
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
(``python -m rewriter.policy_server`` starts vLLM with it) and plain ``reload_weights``
elsewhere, and checks the result with the trainer's probe either way
(capture/policy/weights.py).
"""

from __future__ import annotations

from typing import Any


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
