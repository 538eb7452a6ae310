"""The fix for prompt logprobs under a LoRA adapter on vLLM's CPU backend, for any batch
(imported inside vLLM's worker by policy_server/worker.py; never by the proxy).

Why it is needed: vLLM computes a request's ``prompt_logprobs`` by running its logits layer on
the rows of the step's hidden states that are that request's prompt. With a LoRA adapter
loaded, that layer (``LogitsProcessorWithLoRA``) adds the adapter through the punica
wrapper's ``sampler_indices``: one LoRA slot per request of the batch, made for the one
sampled row per request. On the CPU wrapper those indices meet the prompt's rows in an
``einsum``: with one request in the step they broadcast (every row is that request's, so the
answer is right), with two or more the shapes differ and the engine dies
(``einsum(): subscript b has size 2 for operand 1 which does not broadcast with previously
seen size 50``), taking every generation in flight with it. agenttap asks for prompt logprobs
beside generations all the time (weight probes, fingerprints, health checks, re-scored
history), so a LoRA-serving replica would crash at its first busy moment.

``patch_lora_prompt_logprobs`` makes each such call use the slots of the rows it is given: the
punica wrapper's per-token slots (``token_lora_indices``, in the step's token order, which is
the hidden states' row order) for those rows, put in place of the per-request ones for the
call and put back after it. A row's slot is its own request's, so the logits are the ones the
request would get alone.
"""

from __future__ import annotations

import functools
from typing import Any


def logits_wrapper(model: Any) -> Any:
    """The punica wrapper of ``model``'s LoRA logits layer (None: no LoRA, or not the CPU
    wrapper, whose indices this fix is about)."""
    for module in model.modules():
        if type(module).__name__ != "LogitsProcessorWithLoRA":
            continue
        wrapper = getattr(module, "punica_wrapper", None)
        if wrapper is not None and type(wrapper).__name__ == "PunicaWrapperCPU":
            return wrapper
    return None


def row_offset(part: Any, whole: Any) -> int | None:
    """Where ``part`` (a slice of rows of ``whole``, sharing its storage) starts in ``whole``;
    None where it is not such a slice."""
    if (
        part.dim() != 2
        or whole.dim() != 2
        or part.untyped_storage().data_ptr() != (whole.untyped_storage().data_ptr())
    ):
        return None
    step = whole.stride(0)
    start = part.storage_offset() - whole.storage_offset()
    if step <= 0 or start < 0 or start % step:
        return None
    return start // step


def patch_lora_prompt_logprobs() -> bool:
    """Wrap vLLM's model runner's prompt-logprobs step as the module's docstring says
    (idempotent); False where this vLLM has no such runner."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    original = GPUModelRunner._get_prompt_logprobs_dict
    if getattr(original, "agenttap_lora_rows", False):
        return True

    @functools.wraps(original)
    def _get_prompt_logprobs_dict(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        wrapper = None
        if getattr(self, "lora_config", None):
            # Found once per model, not by walking its modules at every step.
            model, wrapper = getattr(self, "_agenttap_lora_wrapper", (None, None))
            if model is not self.model:
                wrapper = logits_wrapper(self.model)
                self._agenttap_lora_wrapper = (self.model, wrapper)
        if wrapper is None:
            return original(self, hidden_states, *args, **kwargs)
        per_token = wrapper.token_lora_indices.clone()
        kept_len = wrapper.indices_len[1]
        kept = wrapper._sampler_indices[: max(kept_len or 0, 0)].clone()
        compute = self.model.compute_logits

        @functools.wraps(compute)
        def compute_logits(rows: Any, *a: Any, **k: Any) -> Any:
            start = row_offset(rows, hidden_states)
            count = rows.shape[0] if rows.dim() == 2 else 0
            if start is None or start + count > per_token.numel():
                return compute(rows, *a, **k)  # not the prompt's rows: vLLM's own way
            wrapper._sampler_indices[:count].copy_(per_token[start : start + count])
            wrapper.indices_len[1] = count
            try:
                return compute(rows, *a, **k)
            finally:
                wrapper._sampler_indices[: kept.numel()].copy_(kept)
                wrapper.indices_len[1] = kept_len

        self.model.compute_logits = compute_logits
        try:
            return original(self, hidden_states, *args, **kwargs)
        finally:
            del self.model.compute_logits

    _get_prompt_logprobs_dict.agenttap_lora_rows = True  # type: ignore[attr-defined]
    GPUModelRunner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict
    return True
