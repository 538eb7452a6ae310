"""A trainer's side of a weight update, for the real-vLLM weight tests. Runs where torch and
transformers are (.venv-vllm), not in the proxy's environment:

    python tests/support/weights_step.py step SRC OUT SEED      a training step, saved; prints the probe
    python tests/support/weights_step.py corrupt SRC OUT        SRC with one tensor changed, saved
    python tests/support/weights_step.py probe MODEL_DIR        the probe of MODEL_DIR's weights
    python tests/support/weights_step.py lora BASE OUT SEED     a LoRA adapter of BASE (PEFT; .venv-train)
                                                        saved alone; prints its probe
    python tests/support/weights_step.py score-lora BASE ADAPTER < {"rows": [[ids]]}: the PEFT forward

``step``: every 2-D weight moved (noise of 0.05), the input embedding scaled by 1.5 (with tied
embeddings, the output layer too), ``save_pretrained`` (a tied model writes
``model.embed_tokens.weight`` and no ``lm_head.weight``), the tokenizer files copied; prints the
probe (capture.train.probe.weights_probe) the trainer computes from the model in memory.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _load(src: str):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(src)


def _save(model, src: str, out: str) -> None:  # type: ignore[no-untyped-def]
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(src).iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, Path(out) / f.name)


def step(src: str, out: str, seed: int) -> None:
    import torch

    from capture.train.probe import weights_probe

    model, tokenizer = _load(src)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.add_(torch.randn_like(param) * 0.05)
        model.get_input_embeddings().weight.mul_(1.5)
    _save(model, src, out)
    json.dump(weights_probe(model, tokenizer), sys.stdout)


def corrupt(src: str, out: str) -> None:
    import torch

    model, _ = _load(src)
    torch.manual_seed(7)
    with torch.no_grad():
        weight = model.model.layers[-1].mlp.down_proj.weight
        weight.add_(torch.randn_like(weight) * 0.5)
    _save(model, src, out)


def probe(src: str) -> None:
    from capture.train.probe import weights_probe

    model, tokenizer = _load(src)
    json.dump(weights_probe(model, tokenizer), sys.stdout)


def lora(base: str, out: str, seed: int) -> None:
    """A trained adapter as a trainer has one: random, non-zero (a fresh LoRA changes nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from capture.train.probe import weights_probe

    model, tokenizer = _load(base)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
    )  # fmt: skip
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)  # the adapter alone
    json.dump(weights_probe(peft_model, tokenizer), sys.stdout)


def score_lora(base: str, adapter: str) -> None:
    import torch
    from peft import PeftModel

    model, _ = _load(base)
    peft_model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for ids in json.load(sys.stdin)["rows"]:
            logp = torch.log_softmax(peft_model(torch.tensor([ids])).logits[0].float(), dim=-1)
            picked = logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
            out.append([0.0, *picked.tolist()])
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "lora":
        lora(args[0], args[1], int(args[2]))
    elif command == "score-lora":
        score_lora(args[0], args[1])
    elif command == "step":
        step(args[0], args[1], int(args[2]))
    elif command == "corrupt":
        corrupt(args[0], args[1])
    else:
        probe(args[0])
