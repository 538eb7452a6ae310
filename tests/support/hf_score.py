"""The HF transformers forward pass (fp32) a trainer would run, for tests that compare it with
what agenttap recorded. Runs in an environment with torch and transformers (.venv-vllm), not
the proxy's:

    python tests/support/hf_score.py score MODEL_DIR < {"rows": [[ids...], ...]}  -> [[logprob...], ...]
    python tests/support/hf_score.py perturb MODEL_DIR OUT_DIR SEED    (new weights: MODEL_DIR's + noise)

``score``: per row, the logprob of each token given the ones before it (entry 0: 0.0).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def score(model_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = json.load(sys.stdin)["rows"]
    out = []
    with torch.no_grad():
        for ids in rows:
            logits = model(torch.tensor([ids])).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            picked = logp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
            out.append([0.0, *picked.tolist()])
    json.dump(out, sys.stdout)


def perturb(model_dir: str, out_dir: str, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    # The tokenizer files too: a folder a policy server could start from as it is.
    for f in Path(model_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, Path(out_dir) / f.name)


if __name__ == "__main__":
    if sys.argv[1] == "score":
        score(sys.argv[2])
    else:
        perturb(sys.argv[2], sys.argv[3], int(sys.argv[4]))
