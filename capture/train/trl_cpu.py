"""GRPO on a CPU with agent-length rows: ``cpu_friendly(model)`` before ``GRPOTrainer(...)``.

Two costs that do not matter on a GPU make TRL's ``GRPOTrainer`` unusable on a CPU for agent
rows (Claude Code's first prompt alone is about 12.8k tokens; measured on this project's 2-core
machine with the tiny Qwen3 of ``.cache/tiny-qwen3``):

- **Attention.** Fixed by ``capture.train.cpu_attention`` (grouped key/value heads and padding
  masks leave the fused CPU kernels: 196 s for one 12.8k-token forward and backward, 4 s after).
- **The LM head over the prompt.** TRL 1.16 scores the completion tokens through a fused,
  chunked LM head (``trl.trainer.utils.add_fused_lm_head``). On a device with Triton it
  projects only the positions that are scored; elsewhere it projects *every* position of the
  batch, prompts included (to keep tile shapes fixed for compilers such as Neuron's), and
  masks them afterwards: 8 rows × 12.8k positions × a 152k vocabulary, about 6 TFLOP per step,
  where the completions need a thousandth of it. ``score_scored_positions_only`` makes that
  choice answer "only the scored positions" on a CPU too. The values are the same (the skipped
  positions are masked to 0 either way); it patches TRL's private ``_use_triton`` as
  ``trl.trainer.utils`` sees it (the kernels themselves still run their plain-torch tiles), and
  does nothing, with a warning, on a TRL that has no such name.

Needs torch, transformers and TRL (``.venv-train``).
"""

from __future__ import annotations

import logging
from typing import Any

from capture.train.cpu_attention import use_cpu_attention

logger = logging.getLogger(__name__)


def score_scored_positions_only() -> bool:
    """Make TRL's fused LM head project only the scored positions on a CPU (idempotent);
    False, with a warning, where this TRL has no such switch."""
    import trl.trainer.utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if original is None:
        logger.warning(
            "capture.train.trl_cpu: this TRL (%s) has no trl.trainer.utils._use_triton; its LM "
            "head may score every prompt position on a CPU (slow for long rows)",
            getattr(__import__("trl"), "__version__", "?"),
        )
        return False
    if getattr(original, "agenttap_cpu_compact", False):
        return True

    def compact_on_cpu(device: Any) -> bool:
        return device.type == "cpu" or bool(original(device))

    compact_on_cpu.agenttap_cpu_compact = True  # type: ignore[attr-defined]
    trl_utils._use_triton = compact_on_cpu
    return True


def cpu_friendly(model: Any) -> Any:
    """The model with ``capture.train.cpu_attention``'s attention, and TRL's LM head scoring only
    completion positions on a CPU; returns the model."""
    score_scored_positions_only()
    return use_cpu_attention(model)
