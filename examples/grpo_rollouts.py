"""N rollouts of a real CLI agent on one small task, scored, grouped GRPO-style, written as a batch.

    .venv/bin/python examples/grpo_rollouts.py --policy-url http://127.0.0.1:8000 \\
        --tokenizer /models/qwen3 --agent claude-code --n 8 --out grpo-run

agenttap starts (a mitmdump child on free ports), runs --n copies of the agent on the task
below, each in a fresh copy of the task folder and its own session; a verifier scores each
(1.0: hello.txt holds "hi", else 0.0); the rows come back with their rewards. Advantages are
computed per rollout, as GRPO does: a rollout's reward minus the mean reward of its group's
rollouts (the n rollouts of one task; each rollout counts once, however many rows it made), and
every row of the rollout gets its rollout's advantage. Only the main and subagent rows are
trained: auxiliary rows (the agent's side calls: a title, a router's model choice) are left out.
A rollout without a reward (its agent or verifier failed) is left out. The batch
(``capture.reader.to_rl_batch``: prompts, responses, masks, rollout logprobs, rewards, group ids)
plus ``advantages`` is saved to OUT/batch.npz, ready for a trainer's update step. Copy this
file and change TASK, VERIFIER and the update.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capture.client.launcher import AgentTap  # noqa: E402
from capture.storage.reader import to_rl_batch  # noqa: E402

TASK = "Create a file hello.txt containing exactly: hi"
# Runs in the rollout's copy of the task folder; its last line is the reward.
VERIFIER = ["sh", "-c", 'if [ "$(cat hello.txt 2>/dev/null)" = hi ]; then echo 1; else echo 0; fi']


def grpo_advantages(rewards: dict[str, float], groups: dict[str, str]) -> dict[str, float]:
    """Per rollout (keyed by its session id): its reward minus the mean reward of the rollouts
    of its group (``groups``: rollout -> group)."""
    members: dict[str, list[float]] = {}
    for rollout, reward in rewards.items():
        members.setdefault(groups[rollout], []).append(reward)
    return {
        rollout: reward - float(np.mean(members[groups[rollout]]))
        for rollout, reward in rewards.items()
    }


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

    # One reward per rollout; its group is the rollout request's (the n copies of one task).
    scored = [
        run for run in result["rollouts"]
        if run["reward"] is not None and math.isfinite(run["reward"])
    ]  # fmt: skip
    for run in result["rollouts"]:
        if run not in scored:
            print(f"rollout {run['index']}: no reward ({run['error']}); left out")
    rewards = {run["session_id"]: float(run["reward"]) for run in scored}
    groups = {run["session_id"]: result["group_id"] for run in scored}
    per_rollout = grpo_advantages(rewards, groups)

    # The live (non-dead) main and subagent rows of the scored rollouts: each carries its
    # rollout's reward (a closed session's reward is set on those rows; auxiliary rows get none).
    rows = [r for run in scored for r in run["rows"] if not r["dead"]]
    batch = to_rl_batch(rows, pad_id=args.pad_id, truncation="left", kinds=("main", "subagent"))
    if not batch["session_id"]:
        sys.exit("no rows: no scored rollout made a model call (see each rollout's agent_output)")
    advantages = np.array([per_rollout[sid] for sid in batch["session_id"]], dtype=np.float64)
    arrays = {k: v for k, v in batch.items() if isinstance(v, np.ndarray)}
    np.savez(out / "batch.npz", advantages=advantages, **arrays)
    (out / "batch.json").write_text(
        json.dumps(
            {
                "rows": len(batch["session_id"]),
                "group_id": batch["group_id"],
                "session_id": batch["session_id"],
                "rewards": batch["reward"].tolist(),
                "advantages": advantages.tolist(),
                "rollouts": {
                    sid: {"reward": rewards[sid], "advantage": per_rollout[sid]} for sid in rewards
                },
            },
            indent=1,
        )
    )
    print(f"{len(batch['session_id'])} rows of {len(scored)} rollouts, rollout rewards "
          f"{list(rewards.values())}, advantages {[round(a, 3) for a in per_rollout.values()]} "
          f"-> {out / 'batch.npz'}")  # fmt: skip


if __name__ == "__main__":
    main()
