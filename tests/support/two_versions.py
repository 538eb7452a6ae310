"""Two weight versions and rows sampled under them, for check_logprobs' version test
(tests/unit/train/test_check_logprobs_models.py). Runs in the trainer's environment
(.venv-train: torch, transformers), as a trainer's side would:

    .venv-train/bin/python tests/support/two_versions.py DIR

DIR/models/1 and DIR/models/2: tiny random Qwen3 models (``save_pretrained``, float32), version
2 being version 1 after a step (every weight moved). DIR/out/threads: thread rows whose trained
tokens carry the logprobs that the weights of the version they are labelled with give (a plain
full forward, log_softmax of the logits): per version two rows, a row spanning the update (its
first reply sampled by version 1, its second by version 2), and ``t-mixed``: a row labelled
version 2 whose logprobs version 1's weights gave (a policy that served other weights than it
said). Prints JSON: the thread ids, and the trained tokens per version.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB = 512


def build(out: Path) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(38)
    first = Qwen3ForCausalLM(config).to(torch.float32)
    first.save_pretrained(out / "models" / "1", safe_serialization=True)
    # A training step: every weight moved.
    with torch.no_grad():
        for param in first.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    first.save_pretrained(out / "models" / "2", safe_serialization=True)
    return {
        v: Qwen3ForCausalLM.from_pretrained(str(out / "models" / v), dtype=torch.float32).eval()
        for v in ("1", "2")
    }


def logprobs_of(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for every i (0.0 at 0): the sampler's logprobs of a sequence."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        scores = torch.log_softmax(logits, dim=-1)
    return [0.0] + [float(scores[i - 1, ids[i]]) for i in range(1, len(ids))]


def row(
    models: Any, thread_id: str, replies: list[tuple[str, str]], rng: random.Random
) -> dict[str, Any]:
    """A row of ``replies``: per reply (label, weights that sampled it) a prompt part (context)
    then 6 sampled tokens, trained, with that weights' logprobs, labelled ``label``."""
    ids: list[int] = [rng.randrange(VOCAB)]
    spans: list[tuple[int, int, str, str]] = []
    for label, sampler in replies:
        ids += [rng.randrange(VOCAB) for _ in range(rng.randint(3, 8))]
        start = len(ids)
        ids += [rng.randrange(VOCAB) for _ in range(6)]
        spans.append((start, len(ids), label, sampler))
    mask = [0] * len(ids)
    logprobs = [0.0] * len(ids)
    for start, end, _, sampler in spans:
        scored = logprobs_of(models[sampler], ids)
        for pos in range(start, end):
            mask[pos], logprobs[pos] = 1, scored[pos]
    return {
        "schema_version": 2,
        "session_id": "s-" + thread_id,
        "thread_id": thread_id,
        "input_ids": ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "provenance": mask,
        "turns": [],
        "weight_versions": [
            {"version": label, "start": start, "end": end} for start, end, label, _ in spans
        ],
    }


def main(folder: str) -> None:
    from capture.storage.shards import THREAD_SCHEMA, write_rows

    out = Path(folder)
    models = build(out)
    rng = random.Random(38)
    rows = [row(models, f"t-v{v}-{k}", [(v, v)], rng) for v in ("1", "2") for k in range(2)]
    rows.append(row(models, "t-update", [("1", "1"), ("2", "2")], rng))
    rows.append(row(models, "t-mixed", [("2", "1")], rng))
    write_rows(out / "out" / "threads", rows, THREAD_SCHEMA, "threads", stem="two-versions")
    tokens: dict[str, int] = {}
    for r in rows:
        for span in r["weight_versions"]:
            tokens[span["version"]] = tokens.get(span["version"], 0) + span["end"] - span["start"]
    print(json.dumps({"threads": [r["thread_id"] for r in rows], "tokens": tokens}))


if __name__ == "__main__":
    main(sys.argv[1])
