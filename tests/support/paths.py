"""Where things are: the repository, the shared tokenizers, the mitmdump and addon the tests
run, the trainer's interpreter; and Qwen3's end-of-turn token."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("AGENTTAP_SHARED", REPO.parent / "shared"))
QWEN3 = SHARED / "tokenizers" / "qwen3"
QWEN25 = SHARED / "tokenizers" / "qwen2.5-instruct"
MITMDUMP = Path(sys.executable).parent / "mitmdump"
CAPTURE = REPO / "addons" / "capture.py"
TRAIN_PYTHON = REPO / ".venv-train" / "bin" / "python"

# Qwen3's <|im_end|>: the token that ends every assistant turn.
IM_END = 151645
