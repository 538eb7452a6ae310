"""Build a tiny random-weight Qwen3 model that a real vLLM can serve.

Runs in the policy server's environment (.venv-vllm: torch + transformers). The model has the
real Qwen3 vocabulary and chat template (copied from the tokenizer folder given), so every
token id the proxy renders is meaningful to it, but only 2 layers of width 64: vLLM starts it on
a CPU in about a minute. Weights are random with a fixed seed, in float32, so sampled logprobs
equal prompt_logprobs of the same sequence to the bit.

    .venv-vllm/bin/python scripts/build_tiny_model.py --tokenizer TOKENIZER_DIR --out DIR [--tied]

``--tied``: the output layer is the input embedding (``tie_word_embeddings=True``, as Qwen3-0.6B
to 4B, Qwen2.5-0.5B to 3B and Llama-3.2-1B/3B ship): ``save_pretrained`` writes
``model.embed_tokens.weight`` and no ``lm_head.weight``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "LICENSE")


def build(tokenizer_dir: Path, out: Path, seed: int, tied: bool = False) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = Qwen3Config(
        vocab_size=source["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # vLLM's CPU attention accepts 32, 64, 80, ...
        max_position_embeddings=32768,
        rope_theta=source.get("rope_theta", 1000000),
        tie_word_embeddings=tied,
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    if tied:
        shape_tied_vocabulary(model, eos_ids=_eos_ids(source, tokenizer_dir))
    else:
        shape_vocabulary(model, config, eos_ids=_eos_ids(source, tokenizer_dir))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # the finished folder appears whole or not at all


def _eos_ids(source: dict, tokenizer_dir: Path) -> list[int]:
    gen = tokenizer_dir / "generation_config.json"
    eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    eos = eos if eos is not None else source.get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def shape_vocabulary(model, config, eos_ids: list[int], allowed: int = 20000) -> None:  # type: ignore[no-untyped-def]
    """Make the random policy behave like a (babbling) chat model rather than uniform noise.

    Hidden dimension 0 of every embedding is a large constant, so after the final norm it acts
    as a bias input to the untied output layer: ordinary tokens below ``allowed`` get no bias,
    the rest of the vocabulary (special and rare tokens) a strongly negative one, and the EOS
    tokens a positive one, so replies end by themselves after a few dozen tokens on average.
    """
    import torch

    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 0.5)
        embed[:, 0] = 4.0
        head = model.lm_head.weight
        head.normal_(0.0, 0.3)
        head[:, 0] = 0.0
        head[allowed:, 0] = -4.0
        for eos in eos_ids:
            head[eos, :] = 0.0
            head[eos, 0] = EOS_BIAS


EOS_BIAS = 0.9  # measured: replies of ~30 tokens on average, a few hit 200


def shape_tied_vocabulary(model, eos_ids: list[int], allowed: int = 20000) -> None:  # type: ignore[no-untyped-def]
    """The same shaping where the output layer is the embedding: dimension 0 is +4 for the
    ordinary tokens, -4 for the rest, a little more than +4 for the EOS tokens; every input
    carries it, so after the final norm it weighs each output token by its own sign."""
    import torch

    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 0.3)
        embed[:allowed, 0] = 4.0
        embed[allowed:, 0] = -4.0
        for eos in eos_ids:
            embed[eos, 1:] = 0.0
            embed[eos, 0] = 4.0 + EOS_BIAS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--tied", action="store_true", help="tie the output layer to the input embedding"
    )
    args = parser.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").exists():
        print(f"error: no tokenizer.json in {args.tokenizer}", file=sys.stderr)
        return 2
    if (args.out / "config.json").exists():
        print(f"tiny model already built at {args.out}")
        return 0
    build(args.tokenizer, args.out, args.seed, tied=args.tied)
    print(f"built tiny Qwen3 model at {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
