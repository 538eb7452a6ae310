"""One thread row's tokens as the trajectory viewer draws them: decoded a page at a time (with
loss mask, provenance, logprobs), its counts by provenance, and its strip of sampled logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from capture.viewer.tree import first_trained

# Tokens per page of a row: a 100k-token row is fetched and drawn a page at a time.
PAGE_TOKENS = 2000
MAX_PAGE_TOKENS = 20_000

PROVENANCE = ("prompt", "sampled", "recomputed", "stale")

Decode = Callable[[Sequence[int]], list[str]]


def ids_only(ids: Sequence[int]) -> list[str]:
    """The decoder when no tokenizer is given: each token shown as its id."""
    return [f"⟨{i}⟩" for i in ids]


def tokenizer_decoder(tokenizer: Any) -> Decode:
    """Each token's own text (a byte-level token that is part of a character shows as the
    replacement character, as the tokenizer decodes it alone)."""

    def decode(ids: Sequence[int]) -> list[str]:
        pieces = tokenizer.convert_ids_to_tokens(list(ids))
        return [
            tokenizer.convert_tokens_to_string([p]) if p is not None else f"⟨{i}⟩"
            for i, p in zip(ids, pieces, strict=True)
        ]

    return decode


def load_decoder(tokenizer_path: str | Path | None) -> Decode:
    if tokenizer_path is None:
        return ids_only
    from rewriter.template import ChatTemplate

    return tokenizer_decoder(ChatTemplate(tokenizer_path).tokenizer)


def token_page(
    row: dict[str, Any], decode: Decode, offset: int = 0, limit: int = PAGE_TOKENS
) -> dict[str, Any]:
    """Tokens ``offset`` .. ``offset + limit`` of a thread row: ids, text, loss mask,
    provenance, logprobs. A ValueError for an offset or limit out of range."""
    ids = row.get("input_ids") or []
    total = len(ids)
    if offset < 0 or (offset > total) or limit < 1 or limit > MAX_PAGE_TOKENS:
        raise ValueError(
            f"offset must be 0..{total} and limit 1..{MAX_PAGE_TOKENS}; got {offset}, {limit}"
        )
    end = min(total, offset + limit)
    page = list(ids[offset:end])
    return {
        "thread_id": row["thread_id"],
        "total": total,
        "offset": offset,
        "ids": page,
        "text": decode(page),
        "loss_mask": list((row.get("loss_mask") or [])[offset:end]),
        "provenance": list((row.get("provenance") or [])[offset:end]),
        "logprobs": [
            round(float(x), 5) if x is not None else None
            for x in (row.get("logprobs") or [])[offset:end]
        ],
    }


def row_overview(row: dict[str, Any]) -> dict[str, Any]:
    """A row's counts by provenance and loss mask (the legend's numbers), and its ``strip``."""
    prov = row.get("provenance") or []
    mask = row.get("loss_mask") or []
    counts = {name: 0 for name in PROVENANCE}
    for p in prov:
        if 0 <= p < len(PROVENANCE):
            counts[PROVENANCE[p]] += 1
    return {
        "provenance": counts,
        "trained": int(sum(mask)),
        "total": len(prov),
        "first_trained": first_trained(mask),
        "strip": logprob_strip(row),
    }


# Points in a row's logprob strip: one per sampled token up to this many, else each point is
# the mean (and min) of a run of consecutive sampled tokens.
STRIP_POINTS = 1200


def entropy(top_logprobs: Sequence[float] | None) -> float | None:
    """The entropy (nats) of a position's top-k distribution, renormalised over the k: a lower
    bound on the policy's whole entropy there; None without top-k."""
    if not top_logprobs:
        return None
    probs = [math.exp(x) for x in top_logprobs if x is not None]
    total = sum(probs)
    if total <= 0:
        return None
    return -sum(p / total * math.log(p / total) for p in probs if p > 0)


def logprob_strip(row: dict[str, Any], points: int = STRIP_POINTS) -> dict[str, Any]:
    """The logprobs of a row's sampled (and recomputed) tokens, in order, for the strip drawn
    under the row's header: ``pos`` (each point's first position), ``end`` (one past its last),
    ``lp`` (mean logprob), ``min``; ``entropy`` where the row carries top-k logprobs
    (``top_logprobs``, a list per position), else None."""
    prov = row.get("provenance") or []
    lps = row.get("logprobs") or []
    tops = row.get("top_logprobs")
    sampled = [i for i, p in enumerate(prov) if p in (1, 2) and i < len(lps) and lps[i] is not None]
    size = max(1, math.ceil(len(sampled) / points))
    out: dict[str, Any] = {"bucket": size, "pos": [], "end": [], "lp": [], "min": []}
    ents: list[float | None] = []
    for k in range(0, len(sampled), size):
        chunk = sampled[k : k + size]
        values = [float(lps[i]) for i in chunk]
        out["pos"].append(chunk[0])
        out["end"].append(chunk[-1] + 1)
        out["lp"].append(round(sum(values) / len(values), 4))
        out["min"].append(round(min(values), 4))
        if tops is not None:
            found = [e for e in (entropy(tops[i]) for i in chunk if i < len(tops)) if e is not None]
            ents.append(round(sum(found) / len(found), 4) if found else None)
    out["entropy"] = ents if tops is not None and any(e is not None for e in ents) else None
    return out
