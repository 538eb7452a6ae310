"""The trainer's forward against every row the session's real-vLLM tests recorded: run by
tests/conftest.py (tests/support/proxies.py's check_recorded_rows) when the shared vLLM stops, in
the trainer's environment (.venv-train):

    .venv-train/bin/python tests/support/check_rows.py MODEL_DIR OUT [OUT ...]

Every trained token labelled with the model's own weights (``default``: rows of a test that
pushed other weights name them, and are checked where they name ``default``) must carry the
logprob the HF forward (fp32) gives it, within 1e-3 (capture/train/check_logprobs.py). Prints
each folder's rows, tokens and max |diff|; exits 1 past the tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

from capture.storage.reader import load_threads
from capture.train.check_logprobs import DEFAULT_TOLERANCE, check_rows, load_model

COLUMNS = ["session_id", "thread_id", "input_ids", "loss_mask", "logprobs", "weight_versions"]


def main(model_dir: str, outs: list[str]) -> int:
    model = load_model(model_dir)
    worst, tokens, rows = 0.0, 0, 0
    for out in outs:
        if not (Path(out) / "threads").is_dir():
            continue
        report = check_rows(model, load_threads(out, columns=COLUMNS, rewards=False), "default")
        if not report.rows:
            continue
        rows, tokens = rows + len(report.rows), tokens + report.tokens
        worst = max(worst, report.max_diff)
        flag = "  OVER" if report.max_diff > DEFAULT_TOLERANCE else ""
        print(f"{report.max_diff:9.2e} max |diff| over {report.tokens:6d} tokens, "
              f"{len(report.rows):3d} rows: {out}{flag}")  # fmt: skip
    print(f"trainer forward vs rows: {rows} rows, {tokens} trained tokens, max |diff| {worst:.2e}")
    return 1 if worst > DEFAULT_TOLERANCE else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
