"""The probe a trainer sends with its weights, computed inside a real TRL ``GRPOTrainer`` step, as
examples/train_grpo.py computes it (tests/unit/train/test_probe.py). Runs in the trainer's
environment (.venv-train: torch, transformers, TRL):

    .venv-train/bin/python tests/support/probe_under_trl.py DIR

The tiny Qwen3 of .cache/tiny-qwen3, copied to DIR with ``attention_dropout`` 0.3 (so a forward
in train mode is not the weights' forward either), trained one GRPO step on the CPU with TRL's
defaults (``GRPOConfig``'s ``bf16``: accelerate wraps ``model.forward`` in bf16 autocast) and
``capture.train.trl_cpu.cpu_friendly``, on rows a stand-in rollout function makes. After the
optimizer step (``on_step_end``, where the example pushes), the model is saved and prints JSON:

- ``probe_vs_saved``: max |diff| between ``weights_probe`` of the model in memory and the probe of
  the saved folder loaded afresh (what a policy server loads);
- ``wrapped_vs_saved``: the same for the model's forward as the trainer wrapped it (eval mode,
  no gradients): the trainer's autocast, which the probe must leave out;
- ``train_mode_vs_saved``: the same for a forward in train mode (dropout on);
- ``mode_before`` / ``mode_after``: ``model.training`` before and after the probe;
- ``bf16``, ``autocast_wrapped``: TRL's config asked for bf16, accelerate wrapped the forward.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from policy_server.launcher import DEFAULT_MODEL_DIR, ensure_tiny_model  # noqa: E402

DROPOUT = 0.3


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"][1:], b["logprobs"][1:], strict=True))


def logprobs_of(forward: Any, ids: list[int]) -> dict[str, Any]:
    import torch

    logits = forward(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    picked = logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return {"ids": ids, "logprobs": [None, *picked.tolist()]}


def main(folder: Path) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from capture.train.probe import weights_probe
    from capture.train.trl_cpu import cpu_friendly

    source = ensure_tiny_model(DEFAULT_MODEL_DIR)
    model_dir = folder / "model"
    shutil.copytree(source, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["attention_dropout"] = DROPOUT
    (model_dir / "config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)

    def rollouts(prompts: list[str], trainer: Any = None) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "score": [],
        }  # fmt: skip
        for i, prompt in enumerate(prompts):
            out["prompt_ids"].append(tokenizer.encode(prompt))
            out["completion_ids"].append([100 + 37 * i + k for k in range(6)])
            out["logprobs"].append([-1.0] * 6)
            out["env_mask"].append([1] * 6)
            out["score"].append(float(i % 2))
        return out

    def reward(completions: list[Any], score: list[float], **_: Any) -> list[float]:
        return list(score)

    found: dict[str, Any] = {}

    class Probe(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model = kwargs["model"]
            found["bf16"] = bool(args.bf16)
            found["autocast_wrapped"] = "_original_forward" in vars(model)
            found["mode_before"] = model.training
            probe = weights_probe(model, kwargs["processing_class"])
            found["mode_after"] = model.training
            saved = folder / "saved"
            model.save_pretrained(saved)
            reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
            served = weights_probe(reloaded, ids=probe["ids"])
            found["probe_vs_saved"] = max_diff(probe, served)
            with torch.no_grad():
                model.eval()
                found["wrapped_vs_saved"] = max_diff(logprobs_of(model, probe["ids"]), served)
                model.train()
                found["train_mode_vs_saved"] = max_diff(logprobs_of(model, probe["ids"]), served)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cpu_friendly(model)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[reward],
        args=GRPOConfig(
            output_dir=str(folder / "trainer"),
            use_cpu=True,
            use_vllm=False,
            max_steps=1,
            per_device_train_batch_size=4,
            num_generations=2,
            learning_rate=0.01,
            beta=0.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        ),  # fmt: skip
        train_dataset=Dataset.from_dict({"prompt": ["Say hello.", "SHOUT IT."] * 4}),
        rollout_func=rollouts,
        callbacks=[Probe()],
    )
    trainer.train()
    print(json.dumps(found))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
