"""The probe a weight update carries (``POST /policy/weights`` ``"probe"``): a short, fixed token
sequence and the logprobs the trainer's own model, in memory, gives it. agenttap asks each
policy server for the same sequence's ``prompt_logprobs`` after it loaded the new weights and
keeps out of rotation any server further than ``agenttap_weights_tolerance`` from them
(capture/policy/weights.py).

    from capture.train.probe import weights_probe
    tap.update_weights(folder, "step-3", probe=weights_probe(model, tokenizer))
    # or: tap.update_weights(folder, "step-3", model=model, tokenizer=tokenizer)

Needs torch (the trainer's environment), imported when called.
"""

from __future__ import annotations

from typing import Any

# Ordinary chat text, special tokens, code and digits: every layer and a spread of the output
# layer's rows take part (a stale output row for a token the probe holds shows at once).
PROBE_TEXT = (
    "<|im_start|>user\nWhat is 17 * 23? Answer in one line.<|im_end|>\n"
    "<|im_start|>assistant\n17 * 23 = 391. def f(x): return x ** 2  # naïve 日本\n"
)
# Without a tokenizer: ids spread over the first thousand (ordinary tokens of any vocabulary).
FALLBACK_IDS = [100 + (i * 7919) % 900 for i in range(48)]
MAX_PROBE_TOKENS = 256


def probe_ids(tokenizer: Any = None) -> list[int]:
    """The probe's token ids: ``PROBE_TEXT`` as ``tokenizer`` encodes it (no special tokens
    added), else ``FALLBACK_IDS``."""
    if tokenizer is None:
        return list(FALLBACK_IDS)
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    return [int(i) for i in ids[:MAX_PROBE_TOKENS]]


def plain_forward(model: Any) -> Any:
    """``model``'s forward as its weights define it, without what a trainer wrapped around it:
    the module a DataParallel / DistributedDataParallel wrapper holds, and the forward before
    accelerate's mixed-precision wrapper (``Accelerator.prepare`` with ``bf16``/``fp16``, which
    TRL's ``GRPOConfig`` turns on by default, replaces ``model.forward`` by one that runs in
    ``torch.autocast`` and keeps the original as ``model._original_forward``)."""
    while type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(
        model, "module"
    ):
        model = model.module
    return vars(model).get("_original_forward") or model.forward


def weights_probe(
    model: Any, tokenizer: Any = None, ids: list[int] | None = None
) -> dict[str, Any]:
    """``{"ids", "logprobs"}``: the logprob ``model`` (a causal LM in memory: transformers, a
    PEFT model; as a trainer holds it, wrapped or not) gives each id given the ones before it,
    the first None. The logprobs of its weights as they are, the way a policy server loads them
    from the folder ``save_pretrained`` writes: in eval mode (no dropout), without gradients,
    outside any autocast (a trainer's mixed precision would move them by ~0.05 in bf16: the
    servers compute in the weights' own dtype), the logits taken to fp32. Each module's mode
    is restored."""
    import torch

    ids = list(ids) if ids is not None else probe_ids(tokenizer)
    if len(ids) < 2:
        raise ValueError("a probe needs at least 2 token ids")
    device = next(model.parameters()).device
    forward = plain_forward(model)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
            logits = forward(torch.tensor([ids], device=device)).logits[0].float()
    finally:
        for module, training in modes:  # each as it was (a trainer may keep some in eval)
            module.train(training)
    logp = torch.log_softmax(logits[:-1], dim=-1)
    picked = logp.gather(1, torch.tensor(ids[1:], device=device).unsqueeze(1)).squeeze(1)
    return {"ids": ids, "logprobs": [None, *(float(x) for x in picked.cpu().tolist())]}
