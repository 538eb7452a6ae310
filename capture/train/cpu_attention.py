"""Attention for training and scoring agent rows on a CPU: ``use_cpu_attention(model)``.

Agent rows are long (Claude Code's first prompt alone is about 12.8k tokens), and on a CPU
transformers' ``sdpa`` is slow for them in two ways, both measured on this project's 2-core
machine at 12.8k tokens (2 heads, 1 key/value head, head size 32):

- a model with grouped key/value heads (Qwen3) calls ``scaled_dot_product_attention`` with
  ``enable_gqa=True``, whose backward has no fused CPU kernel: 96 s per layer, against 1.1 s
  with the key/value heads repeated first;
- a batch with padding gets a (batch, 1, L, L) boolean mask (1.3 GB for 8 rows) and the masked
  kernel: 3.5 s per row and layer, against 1.5 s for ``is_causal`` on the row's own tokens.

So this attention repeats the key/value heads, and its mask function hands over only the 2-D
padding mask: each row runs the causal kernel on its own tokens (its one contiguous span of
real tokens: left-padded prompt, right-padded completion), its padding gets zeros (masked out of
every loss). Anything else (a cache, a mask with holes) goes the standard masked way. The
result is the same attention, up to float rounding.

Needs torch and transformers: import it in the trainer's environment (``.venv-train``).
"""

from __future__ import annotations

from typing import Any

NAME = "agenttap_cpu_sdpa"


def _mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: Any = None,
    **kwargs: Any,
) -> Any:
    """The 2-D padding mask (or None: no padding) for a whole-sequence forward; the standard
    4-D mask for anything else (a forward on a cache)."""
    from transformers.masking_utils import sdpa_mask

    whole = q_offset == 0 and kv_offset == 0 and q_length == kv_length
    if not whole or kwargs.get("local_size") is not None:
        return sdpa_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset,
            attention_mask=attention_mask, **kwargs,
        )  # fmt: skip
    if attention_mask is None:
        return None
    padding = attention_mask[:, :kv_length].bool()
    return None if bool(padding.all()) else padding


def _attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_: Any,
) -> tuple[Any, None]:
    import torch
    import torch.nn.functional as F

    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:  # the fused CPU kernels have a backward only without enable_gqa
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    dropout = dropout if module.training else 0.0
    q_len, kv_len = query.shape[2], key.shape[2]

    def causal(q: Any, k: Any, v: Any) -> Any:
        if q.shape[2] == k.shape[2]:
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=q.shape[2] > 1
            )
        # Queries at the end of the keys (a forward on a cache): bottom-right aligned.
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        allowed = allowed.tril(diagonal=k.shape[2] - q.shape[2])
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scaling
        )

    if attention_mask is None:
        out = causal(query, key, value)
    elif attention_mask.dim() == 2 and q_len == kv_len:
        out = torch.zeros_like(query)
        for row in range(query.shape[0]):
            real = attention_mask[row].nonzero().flatten()
            if real.numel() == 0:
                continue
            start, end = int(real[0]), int(real[-1]) + 1
            if end - start != real.numel():  # holes in the row: the masked kernel
                allowed = attention_mask[row][None, :].expand(q_len, kv_len)
                allowed = allowed & torch.ones_like(allowed).tril()
                out[row] = F.scaled_dot_product_attention(
                    query[row : row + 1], key[row : row + 1], value[row : row + 1],
                    attn_mask=allowed[None, None], dropout_p=dropout, scale=scaling,
                )[0]  # fmt: skip
                continue
            span = slice(start, end)
            out[row, :, span] = causal(
                query[row : row + 1, :, span],
                key[row : row + 1, :, span],
                value[row : row + 1, :, span],
            )[0]
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
        )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make ``NAME`` a transformers attention implementation (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def use_cpu_attention(model: Any) -> Any:
    """Switch ``model`` (a transformers causal LM) to this attention; returns the model."""
    model.set_attn_implementation(register())
    return model
