"""N rollouts of a real CLI agent on one small task, scored, grouped GRPO-style, written as a batch.

    .venv/bin/python examples/grpo_rollouts.py --policy-url http://127.0.0.1:8000 \\
        --tokenizer /models/qwen3 --agent claude-code --n 8 --out grpo-run

agenttap starts (a mitmdump child on free ports), runs --n copies of the agent on the task
below, each in a fresh copy of the task folder and its own session; a verifier scores each
(1.0: hello.txt holds "hi", else 0.0); the rows come back with their rewards. Each row's
advantage is its reward minus the mean reward of its group (the n rollouts of one task), as
GRPO computes it. The batch (``capture.reader.to_rl_batch``: prompts, responses, masks, rollout
logprobs, rewards, group ids) plus ``advantages`` is saved to OUT/batch.npz, ready for a
trainer's update step. Copy this file and change TASK, VERIFIER and the update.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capture.launcher import AgentTap  # noqa: E402
from capture.reader import to_rl_batch  # noqa: E402

TASK = "Create a file hello.txt containing exactly: hi"
# Runs in the rollout's copy of the task folder; its last line is the reward.
VERIFIER = ["sh", "-c", 'if [ "$(cat hello.txt 2>/dev/null)" = hi ]; then echo 1; else echo 0; fi']


def grpo_advantages(rewards: np.ndarray, groups: list[str]) -> np.ndarray:
    """reward - mean reward of its group (rows with no reward count as 0)."""
    rewards = np.nan_to_num(rewards.astype(np.float64), nan=0.0)
    out = np.zeros_like(rewards)
    for group in set(groups):
        members = np.array([g == group for g in groups])
        out[members] = rewards[members] - rewards[members].mean()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy-url", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--agent", default="claude-code", help="claude-code, codex or gemini")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-calls", type=int, default=20)
    parser.add_argument("--out", default="grpo-run")
    parser.add_argument("--pad-id", type=int, default=151643)  # Qwen's <|endoftext|>
    args = parser.parse_args()
    out = Path(args.out).resolve()  # the same from any working directory
    task = out / "task"
    task.mkdir(parents=True, exist_ok=True)
    (task / "TASK.md").write_text(TASK + "\n")

    with AgentTap.start(args.policy_url, args.tokenizer, out / "shards") as tap:
        result = tap.rollout(
            args.agent, TASK, n=args.n, workdir=task, verifier=VERIFIER,
            limits={"max_calls": args.max_calls}, metadata={"task_id": "hello", "split": "train"},
        )  # fmt: skip
    for run in result["rollouts"]:
        print(f"rollout {run['index']}: {run['status']} {run['finish_reason']} "
              f"reward={run['reward']} calls={run['metrics'].get('calls')}")  # fmt: skip

    # The live (non-dead) rows of every rollout, each with its rollout's reward and group.
    rows = [r for run in result["rollouts"] for r in run["rows"] if not r["dead"]]
    if not rows:
        sys.exit("no rows: no rollout made a model call (see each rollout's agent_output)")
    batch = to_rl_batch(rows, pad_id=args.pad_id, truncation="left")
    advantages = grpo_advantages(batch["reward"], batch["group_id"])
    arrays = {k: v for k, v in batch.items() if isinstance(v, np.ndarray)}
    np.savez(out / "batch.npz", advantages=advantages, **arrays)
    (out / "batch.json").write_text(
        json.dumps(
            {
                "rows": len(rows),
                "group_id": batch["group_id"],
                "session_id": batch["session_id"],
                "rewards": [None if np.isnan(x) else float(x) for x in batch["reward"]],
                "advantages": advantages.tolist(),
            },
            indent=1,
        )
    )
    print(f"{len(rows)} rows, rewards {batch['reward'].tolist()}, advantages "
          f"{advantages.round(3).tolist()} -> {out / 'batch.npz'}")  # fmt: skip


if __name__ == "__main__":
    main()
